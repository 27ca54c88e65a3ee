"""Fails when a picture Graphviz drew (architecture.svg) would be hard to read; run by generate.sh, so by CI too.

    python3 docs/pictures/check_svg.py docs/pictures/architecture.svg

Each text's box is measured with the font dot laid it out in (DejaVu Sans: the advance widths of its glyphs, read
with fontTools from the copy matplotlib ships; the height from the font size), and then:

- every text lies within the picture (nothing cut off at an edge);
- a node's text lies within its box, a cluster's label within its cluster;
- no two texts overlap, and no edge's label lies on a node;
- no edge passes through a text (an arrow drawn across a label).
"""

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib
from fontTools.ttLib import TTFont

SVG = "{http://www.w3.org/2000/svg}"
FONT = TTFont(Path(matplotlib.get_data_path()) / "fonts/ttf/DejaVuSans.ttf")
CMAP = FONT.getBestCmap()
HMTX = FONT["hmtx"]
UNITS = FONT["head"].unitsPerEm
ASCENT, DESCENT = 0.76, 0.24  # DejaVu Sans, of the font size: the box of a line around its baseline
SLACK = 0.5  # points: what rounding in dot's own output may account for


def width(text, size):
    total = 0
    for ch in text:
        glyph = CMAP.get(ord(ch)) or CMAP.get(ord("M"))
        total += HMTX[glyph][0]
    return total * size / UNITS


def numbers(text):
    return [float(v) for v in re.findall(r"-?[0-9]*\.?[0-9]+(?:e-?[0-9]+)?", text)]


class Box:
    def __init__(self, x0, y0, x1, y1, what):
        self.x0, self.y0, self.x1, self.y1, self.what = x0, y0, x1, y1, what

    def inside(self, other, slack=SLACK):
        return (
            self.x0 >= other.x0 - slack
            and self.y0 >= other.y0 - slack
            and self.x1 <= other.x1 + slack
            and self.y1 <= other.y1 + slack
        )

    def overlaps(self, other, by=SLACK):
        return min(self.x1, other.x1) - max(self.x0, other.x0) > by and min(self.y1, other.y1) - max(self.y0, other.y0) > by

    def contains(self, x, y, margin=0.0):
        return self.x0 + margin < x < self.x1 - margin and self.y0 + margin < y < self.y1 - margin

    def __repr__(self):
        return f"{self.what!r} [{self.x0:.1f},{self.y0:.1f} – {self.x1:.1f},{self.y1:.1f}]"


def text_box(el, dx, dy):
    size = float(el.get("font-size", "14"))
    x, y = float(el.get("x")) + dx, float(el.get("y")) + dy
    content = "".join(el.itertext())
    w = width(content, size)
    anchor = el.get("text-anchor", "start")
    x0 = x - w / 2 if anchor == "middle" else x - w if anchor == "end" else x
    return Box(x0, y - ASCENT * size, x0 + w, y + DESCENT * size, content)


def shape_boxes(group, dx, dy):
    """The visible outlines of a group (paths and polygons drawn with a stroke), as boxes."""
    boxes = []
    for el in group:
        if el.tag not in (SVG + "path", SVG + "polygon"):
            continue
        if el.get("stroke") in ("none", "transparent") and el.get("fill") in ("none", "transparent", None):
            continue
        v = numbers(el.get("d") or el.get("points"))
        xs, ys = [x + dx for x in v[0::2]], [y + dy for y in v[1::2]]
        boxes.append(Box(min(xs), min(ys), max(xs), max(ys), group.findtext(SVG + "title")))
    return boxes


def bezier_points(d, dx, dy, steps=24):
    """Points along a path of dot's edges (M x,y C x1,y1 x2,y2 x3,y3 ...)."""
    v = numbers(d)
    pts = [(v[i] + dx, v[i + 1] + dy) for i in range(0, len(v), 2)]
    out = [pts[0]]
    for i in range(1, len(pts) - 2, 3):
        p0, p1, p2, p3 = pts[i - 1], pts[i], pts[i + 1], pts[i + 2]
        for k in range(1, steps + 1):
            t = k / steps
            a, b, c, e = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3
            out.append((a * p0[0] + b * p1[0] + c * p2[0] + e * p3[0], a * p0[1] + b * p1[1] + c * p2[1] + e * p3[1]))
    return out


def check(path):
    root = ET.parse(path).getroot()
    _, _, vw, vh = numbers(root.get("viewBox"))
    picture = Box(0, 0, vw, vh, "the picture")
    graph = root.find(SVG + "g")
    tx, ty = numbers(re.search(r"translate\(([^)]*)\)", graph.get("transform")).group(1))
    problems, texts, node_shapes, edge_labels, edges = [], [], [], [], []
    for group in graph.iter(SVG + "g"):
        kind = group.get("class")
        if kind not in ("node", "cluster", "edge"):
            continue
        own = [text_box(t, tx, ty) for t in group.findall(SVG + "text")]
        shapes = shape_boxes(group, tx, ty)
        texts.extend(own)
        if kind == "node":
            node_shapes.extend(shapes)
        if kind == "edge":
            edge_labels.extend(own)
            edges.extend(
                (group.findtext(SVG + "title"), bezier_points(p.get("d"), tx, ty)) for p in group.findall(SVG + "path")
            )
        if kind in ("node", "cluster"):
            for box in own:
                # The smallest outline of the group that holds the text's middle must hold all of it.
                cx, cy = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2
                if not shapes:
                    continue  # a text node (shape=plaintext): nothing to hold it but the picture
                holders = sorted((s for s in shapes if s.contains(cx, cy)), key=lambda s: (s.x1 - s.x0) * (s.y1 - s.y0))
                if not holders or not box.inside(holders[0]):
                    where = holders[0] if holders else "no outline"
                    problems.append(f"text outside its {kind}'s box: {box} in {where}")
    for box in texts:
        if not box.inside(picture):
            problems.append(f"text cut off at the picture's edge ({vw:.0f} x {vh:.0f} pt): {box}")
    for i, a in enumerate(texts):
        for b in texts[i + 1 :]:
            if a.overlaps(b):
                problems.append(f"texts overlap: {a} and {b}")
    for label in edge_labels:
        for shape in node_shapes:
            if label.overlaps(shape):
                problems.append(f"an edge's label on a node: {label} on {shape}")
    for name, points in edges:
        for box in texts:
            if any(box.contains(x, y, margin=1.0) for x, y in points):
                problems.append(f"edge {name} drawn through the text {box}")
    return problems


def main():
    failed = False
    for path in sys.argv[1:]:
        problems = check(path)
        for p in problems:
            print(f"check_svg.py: {path}: {p}", file=sys.stderr)
        failed |= bool(problems)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
