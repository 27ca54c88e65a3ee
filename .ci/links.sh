#!/usr/bin/env bash
# Every relative link and #anchor in README.md, docs/**/*.md and the e2e READMEs resolves (GitHub's heading
# slugs): docs/tools/links.py. And README.md stays short enough for a newcomer to read through: at most 1 500
# words as `wc -w` counts them (#54), the rest one click away in docs/. Needs python3 only (standard library).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 docs/tools/links.py
words=$(wc -w < README.md)
[ "$words" -le 1500 ] || { printf 'FAIL (.ci/links.sh): README.md has %s words, more than 1 500: move detail into docs/\n' "$words" >&2; exit 1; }
echo "README.md: $words words (at most 1 500)"
