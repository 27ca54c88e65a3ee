#!/usr/bin/env bash
# Draws every picture of docs/pictures from its source, never by hand:
#   architecture.svg  from architecture.dot (Graphviz dot)
#   neighbour.svg     from the raw logs in e2e/gpu/results/*.tgz      (plots.py, matplotlib)
#   story.svg         from e2e/cluster/results/*realk8s*.txt           (plots.py, matplotlib)
#
#   bash docs/pictures/generate.sh [OUTDIR]      # default: docs/pictures itself
#
# Needs dot (Debian's graphviz, with fonts-dejavu-core: the node sizes are measured in that font) and a python3
# with the packages of requirements.txt ($PYTHON, default python3). .ci/pictures.sh installs both, regenerates
# and fails when the committed SVGs differ, or when a picture is not readable (check_svg.py, plots.py's
# check_layout: a text cut off, out of its box or on another, bars or lines drawn on one another). The output is byte-for-byte the same on every run with the same
# tools: dot writes no date, and plots.py fixes matplotlib's hash salt and leaves the date out.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
command -v dot >/dev/null || { echo "generate.sh: no dot (apt-get install graphviz fonts-dejavu-core)" >&2; exit 1; }
dot -Tsvg "$HERE/architecture.dot" -o "$OUT/architecture.svg"
# Readable or nothing: a text cut off or outside its box, texts on one another, an edge through a label
# (check_svg.py, measured in DejaVu Sans); plots.py checks its own figures the same way before it saves them.
"$PYTHON" "$HERE/check_svg.py" "$OUT/architecture.svg"
"$PYTHON" "$HERE/plots.py" "$OUT"
echo "pictures written to $OUT: $(cd "$OUT" && ls -- *.svg | tr '\n' ' ')"
