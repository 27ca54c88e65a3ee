"""Every relative link in the project's Markdown resolves: the file or folder exists, and an `#anchor` names a
heading of the target (GitHub's slugs) or an explicit `id`/`name` in it. Run by .ci/links.sh.

    python3 docs/tools/links.py [FILE.md ...]     # default: README.md, docs/**/*.md, e2e/**/README.md

Checked: inline links and images `[text](target)`, reference definitions `[label]: target`, and `href`/`src`
attributes of HTML tags. Not checked: absolute URLs (http:, https:, mailto:), anything inside fenced code
blocks or inline code. Exits 1 and lists every broken link (file:line: target: why).
"""

import re
import sys
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT = ["README.md", "docs/**/*.md", "e2e/**/README.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_ATTR = re.compile(r"<[a-zA-Z][^>]*?\s(?:href|src)\s*=\s*[\"']([^\"']+)[\"']")
HTML_ID = re.compile(r"<[a-zA-Z][^>]*?\s(?:id|name)\s*=\s*[\"']([^\"']+)[\"']")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text):
    """(line number, line) outside fenced code blocks, inline code blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)


def slug(heading):
    """GitHub's anchor for a heading: its text (markup removed), lower case, only letters, digits, spaces,
    hyphens and underscores kept, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.replace("`", "").replace("*", "")
    text = text.lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path, cache={}):
    """Every anchor a Markdown file defines: its headings' slugs (repeats get -1, -2, ...) and HTML ids."""
    if path not in cache:
        seen, found = {}, set()
        fenced = False
        for line in path.read_text(encoding="utf-8").splitlines():
            if FENCE.match(line):
                fenced = not fenced
                continue
            if fenced:
                continue
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                found.add(base if n == 0 else f"{base}-{n}")
                seen[base] = n + 1
            found.update(HTML_ID.findall(line))
        cache[path] = found
    return cache[path]


def targets(line):
    for pattern in (INLINE_LINK, HTML_ATTR):
        yield from pattern.findall(line)
    m = REFERENCE.match(line)
    if m:
        yield m.group(1)


def check(md):
    problems = []
    for number, line in prose_lines(md.read_text(encoding="utf-8")):
        for target in targets(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            where, _, anchor = target.partition("#")
            dest = md if not where else (md.parent / where).resolve()
            rel = md.relative_to(REPO)
            if not dest.exists():
                problems.append(f"{rel}:{number}: {target}: no such file or folder")
                continue
            try:
                dest.relative_to(REPO)
            except ValueError:
                problems.append(f"{rel}:{number}: {target}: outside the repository")
                continue
            if anchor:
                if dest.suffix != ".md" or dest.is_dir():
                    problems.append(f"{rel}:{number}: {target}: an anchor into a file that is not Markdown")
                elif anchor not in anchors(dest):
                    problems.append(f"{rel}:{number}: {target}: no heading or id '{anchor}' in {dest.relative_to(REPO)}")
    return problems


def main(argv):
    if argv:
        files = [Path(a).resolve() for a in argv]
    else:
        files = sorted({p for pattern in DEFAULT for p in REPO.glob(pattern)})
    problems, links = [], 0
    for md in files:
        problems += check(md)
        links += sum(len(list(targets(line))) for _, line in prose_lines(md.read_text(encoding="utf-8")))
    for problem in problems:
        print(problem)
    print(f"links: {len(files)} Markdown files, {links} links, {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
