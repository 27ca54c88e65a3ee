#!/usr/bin/env bash
# Every relative link and #anchor in README.md, docs/**/*.md and the e2e READMEs resolves (GitHub's heading
# slugs): docs/tools/links.py. Needs python3 only (standard library).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 docs/tools/links.py
