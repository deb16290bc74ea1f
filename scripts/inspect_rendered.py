"""Looks at rendered notebooks the way a reader would: each HTML page (nbconvert's lab template,
which carries JupyterLab's own stylesheet) opened in headless Chromium at 1300 px, a full-page
screenshot saved beside it, and the page checked for what a reader would notice:

- text clipped at an SVG's edge (a label running past its picture),
- a treetrain output wider than the output area (overflowing into a scrollbar),
- text columns that JupyterLab's table rule right-aligned, headers and shape chips that wrap,
- Rust Debug text in an output (`Some(`, `None`, `Struct { field: `),
- a page taller than its limit (05: 8,000 px at the shipped recipe).

    python scripts/inspect_rendered.py target/rendered/NAME.html ...

Prints one line per page (height, outputs checked) and every problem; exit 4 on any problem.
"""
import re
import sys

from playwright.sync_api import sync_playwright

WIDTH = 1300
MAX_HEIGHT = {"05_grpo": 8000}
DEBUG_TEXT = re.compile(r"\bSome\(|\bNone\b(?! \()|\b[A-Z][A-Za-z]+ \{ [a-z_]+: ")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

PROBE = r"""() => {
  const problems = [];
  const outputs = [...document.querySelectorAll('.jp-OutputArea-output')];
  const tt = [...document.querySelectorAll('.tt')];
  const where = el => {
    const cell = el.closest('.jp-Cell');
    const cells = [...document.querySelectorAll('.jp-CodeCell')];
    return cell ? `code cell ${cells.indexOf(cell) + 1}` : 'page';
  };
  for (const svg of document.querySelectorAll('.tt svg')) {
    // Client rectangles, so rotated axis labels are measured as drawn.
    const box = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll('text')) {
      const b = t.getBoundingClientRect();
      if (b.width > 0 && (b.left < box.left - 1 || b.right > box.right + 1 || b.top < box.top - 2 || b.bottom > box.bottom + 2))
        problems.push(`${where(svg)}: SVG text clipped at the edge: "${t.textContent.trim().slice(0, 60)}"`);
    }
  }
  for (const el of tt) {
    if (el.scrollWidth > el.clientWidth + 2)
      problems.push(`${where(el)}: output ${el.scrollWidth}px wide in a ${el.clientWidth}px area`);
  }
  for (const td of document.querySelectorAll('.tt td:not(.num)')) {
    if (getComputedStyle(td).textAlign !== 'left') {
      problems.push(`${where(td)}: a text column is ${getComputedStyle(td).textAlign}-aligned`); break;
    }
  }
  for (const el of document.querySelectorAll('.tt th, .tt code.chip, .tt td.num')) {
    if (getComputedStyle(el).whiteSpace !== 'nowrap') {
      problems.push(`${where(el)}: "${el.textContent.slice(0, 30)}" may wrap mid-value`); break;
    }
  }
  const texts = outputs.map(o => [where(o), o.innerText]);
  return {height: document.documentElement.scrollHeight, outputs: outputs.length, tt: tt.length,
          problems, texts};
}"""


def inspect(page, path, debug_text):
    page.goto("file://" + path)
    page.wait_for_load_state("load")
    found = page.evaluate(PROBE)
    shot = path[: -len(".html")] + ".png"
    page.screenshot(path=shot, full_page=True)
    name = path.rsplit("/", 1)[-1][: -len(".html")]
    problems = list(found["problems"])
    for where, text in found["texts"]:
        for line in text.splitlines():
            if debug_text.search(line):
                problems.append(f"{where}: Debug text in an output: {line.strip()[:100]}")
                break
    limit = MAX_HEIGHT.get(name)
    if limit and found["height"] > limit:
        problems.append(f"page is {found['height']} px tall, the limit is {limit} px")
    print(f"{name}: {found['height']} px tall at {WIDTH} px, {found['outputs']} outputs "
          f"({found['tt']} treetrain displays), screenshot {shot}")
    return [f"{name}: {p}" for p in problems]


def main(paths):
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        for path in paths:
            problems += inspect(page, path, DEBUG_TEXT)
        browser.close()
    for problem in problems:
        print("  problem: " + problem, file=sys.stderr)
    if problems:
        print(f"FAILED: {len(problems)} problem(s) in the rendered notebooks", file=sys.stderr)
        sys.exit(4)


if __name__ == "__main__":
    main([__import__("os").path.abspath(p) for p in sys.argv[1:]])
