"""The web chat's Markdown renderer (core/serve/static/markdown.js) alone, in Debian's chromium.

The script is loaded into a blank page (no server, no Content-Security-Policy: an injected
handler would run here) and `renderMarkdown(source)` is called through page.evaluate; each
case compares the rendered DOM, serialized, with the HTML it must be.
"""

from __future__ import annotations

import pytest
from web_browser import chromium

from bestiary.core.serve.web import static_text

RENDER = "src => { const d = document.createElement('div'); d.append(renderMarkdown(src)); return d.innerHTML; }"
A = 'target="_blank" rel="noopener noreferrer nofollow"'
ALLOWED_TAGS = {"P", "BR", "H1", "H2", "H3", "H4", "H5", "H6", "EM", "STRONG", "DEL", "CODE", "PRE", "DIV", "SPAN",
                "BUTTON", "UL", "OL", "LI", "BLOCKQUOTE", "HR", "A", "TABLE", "THEAD", "TBODY", "TR", "TH", "TD"}


def code_block(code: str, lang: str = "") -> str:
    """The HTML of a fenced code block (its text as innerHTML serializes it)."""
    attr = f' data-lang="{lang}"' if lang else ""
    return (f'<div class="code-block"><div class="code-head"><span class="lang">{lang or "code"}</span>'
            f'<button class="copy" type="button">Copy</button></div><pre><code{attr}>{code}</code></pre></div>')


CASES = {
    "paragraphs and line breaks": ("a\nb\n\nc", "<p>a<br>b</p><p>c</p>"),
    "headings": ("# H1\n### H3 ###\n#nohash", "<h1>H1</h1><h3>H3</h3><p>#nohash</p>"),
    "setext headings": ("Title\n===\nSub\n---", "<h1>Title</h1><h2>Sub</h2>"),
    "emphasis": ("*em* **strong** ***both*** _u_ __uu__ ~~del~~ snake_case_name 2 * 3 * 4",
                 "<p><em>em</em> <strong>strong</strong> <strong><em>both</em></strong> <em>u</em> "
                 "<strong>uu</strong> <del>del</del> snake_case_name 2 * 3 * 4</p>"),
    "nested emphasis": ("**bold *it* more** *a **b***",
                        "<p><strong>bold <em>it</em> more</strong> <em>a <strong>b</strong></em></p>"),
    "code spans": ("use `a*b*c` and ``x ` y``", "<p>use <code>a*b*c</code> and <code>x ` y</code></p>"),
    "unclosed spans are text": ("**open and `tick", "<p>**open and `tick</p>"),
    "escapes": ("\\*not em\\* \\`x\\` \\[y](https://e.com)",
                "<p>*not em* `x` [y](<a href=\"https://e.com/\" " + A + ">https://e.com</a>)</p>"),
    "fenced code": ("```python\ndef f():\n    return '<b>' & 1\n```\nafter",
                    code_block("def f():\n    return '&lt;b&gt;' &amp; 1", "python") + "<p>after</p>"),
    "unclosed fence (streaming)": ("text\n```js\nlet a = 1;", "<p>text</p>" + code_block("let a = 1;", "js")),
    "tilde fence holds backticks": ("~~~\n```\ninner\n```\n~~~", code_block("```\ninner\n```")),
    "bullet list nested": ("- a\n- b\n  - b1\n  - b2\n- c",
                           "<ul><li>a</li><li>b<ul><li>b1</li><li>b2</li></ul></li><li>c</li></ul>"),
    "ordered list nested, loose": ("3. three\n4. four\n   1. sub\n\n5. five",
                                   '<ol start="3"><li>three</li><li>four<ol><li>sub</li></ol></li><li>five</li></ol>'),
    "list items with code": ("1. Run:\n   ```sh\n   ls -l\n   ```\n2. Done",
                             "<ol><li>Run:" + code_block("ls -l", "sh") + "</li><li>Done</li></ol>"),
    "list, then a paragraph": ("- a\n\nafter", "<ul><li>a</li></ul><p>after</p>"),
    "lists of two kinds": ("1. a\n- b", "<ol><li>a</li></ol><ul><li>b</li></ul>"),
    "blockquotes": ("> quote **b**\n> > nested\n\nout",
                    "<blockquote><p>quote <strong>b</strong></p><blockquote><p>nested</p></blockquote></blockquote>"
                    "<p>out</p>"),
    "rules": ("a\n\n***\n\n- - -", "<p>a</p><hr><hr>"),
    "table": ("| a | b | c |\n|:--|:-:|--:|\n| 1 | **2** | x\\|y |\nnext",
              '<div class="table-wrap"><table><thead><tr><th class="align-left">a</th><th class="align-center">b</th>'
              '<th class="align-right">c</th></tr></thead><tbody><tr><td class="align-left">1</td>'
              '<td class="align-center"><strong>2</strong></td><td class="align-right">x|y</td></tr>'
              "</tbody></table></div><p>next</p>"),  # a row needs a "|"
    "table rows short or long": ("a|b\n-|-\n|1|\n|2|3|4|",
                                 '<div class="table-wrap"><table><thead><tr><th>a</th><th>b</th></tr></thead><tbody>'
                                 "<tr><td>1</td><td></td></tr><tr><td>2</td><td>3</td></tr></tbody></table></div>"),
    "links": ('[site](https://example.com/a_(b) "T") <https://x.org> see https://y.org/p.',
              f'<p><a href="https://example.com/a_(b)" {A} title="T">site</a> <a href="https://x.org/" {A}>'
              f'https://x.org</a> see <a href="https://y.org/p" {A}>https://y.org/p</a>.</p>'),
    "an image is a link to it": ("![a cat](https://example.com/cat.png)",
                                 f'<p><a href="https://example.com/cat.png" {A}>a cat</a></p>'),
    "unsafe links are text": ("[x](javascript:alert(1)) [y](data:text/html,hi) [z](/relative) "
                              "[w]( JAVASCRIPT:alert(1)) ![i](javascript:x) <javascript:alert(1)>",
                              "<p>[x](javascript:alert(1)) [y](data:text/html,hi) [z](/relative) "
                              "[w]( JAVASCRIPT:alert(1)) ![i](javascript:x) &lt;javascript:alert(1)&gt;</p>"),
    "HTML is text": ('<script>window.__pwned=1</script>\n<img src=x onerror="window.__pwned=1"> <b>b</b> &amp;',
                     '<p>&lt;script&gt;window.__pwned=1&lt;/script&gt;<br>&lt;img src=x onerror="window.__pwned=1"'
                     "&gt; &lt;b&gt;b&lt;/b&gt; &amp;amp;</p>"),
}

# An answer as a model streams it: every prefix must render (checked below).
SAMPLE = """## Plan

Use **pip** and `venv`:

1. Create it:
   ```bash
   python -m venv .venv <&> "x"
   ```
2. Activate *it*
   - on Linux
   - on Windows

> Note: see [the docs](https://docs.python.org/3/library/venv.html).

| step | time |
|------|-----:|
| 1    | 2 s  |

---
<img src=x onerror="window.__pwned=1"> [bad](javascript:window.__pwned=1)
```python
print("<script>window.__pwned=1</script>")
"""

PREFIXES = """src => {
  const tags = new Set(), fences = [];
  for (let k = 0; k <= src.length; k += 1) {
    const d = document.createElement('div');
    d.append(renderMarkdown(src.slice(0, k)));
    for (const e of d.querySelectorAll('*')) tags.add(e.tagName);
    const blocks = d.querySelectorAll(':scope > .code-block');
    if (blocks.length) fences.push([k, blocks[blocks.length - 1].querySelector('code').textContent]);
  }
  return {tags: [...tags], fences, pwned: window.__pwned === undefined ? null : String(window.__pwned)};
}"""


@pytest.fixture(scope="module")
def page():
    """A blank chromium page with markdown.js loaded."""
    with chromium() as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.set_content("<!doctype html><html><body></body></html>")
        page.add_script_tag(content=static_text("markdown.js"))
        yield page
        assert not errors, errors


@pytest.mark.parametrize("name", list(CASES))
def test_markdown_renders_to_the_expected_dom(page, name):
    source, html = CASES[name]
    assert page.evaluate(RENDER, source) == html


def test_every_prefix_of_a_streamed_answer_renders_safely(page):
    got = page.evaluate(PREFIXES, SAMPLE)
    assert set(got["tags"]) <= ALLOWED_TAGS, set(got["tags"]) - ALLOWED_TAGS
    assert {"H2", "STRONG", "CODE", "PRE", "OL", "UL", "LI", "BLOCKQUOTE", "A", "TABLE", "HR", "EM"} <= set(got["tags"])
    assert got["pwned"] is None, "model output ran a script"
    # While the last fence is open, its block holds the code so far: at the end, the whole of it.
    opened = SAMPLE.rindex("```python\n") + len("```python\n")
    last = dict(got["fences"])
    assert last[len(SAMPLE)] == SAMPLE[opened:]
    assert last[len(SAMPLE) - 10] == SAMPLE[opened:-10]
    assert page.evaluate("document.querySelectorAll('img, script').length") == 1  # markdown.js's own script tag


HOSTILE = {"deep quotes": "> " * 5000 + "x", "open brackets": "[" * 20_000, "open stars": "*a " * 20_000,
           "open underscores": "_x " * 20_000, "open backticks": "`a " * 20_000, "deep bullets": "- " * 5000 + "x",
           "deep numbers": "1. " * 5000, "bracket parens": "](" * 20_000, "autolink openers": "<https://" * 5000}


@pytest.mark.parametrize("source", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_input_renders_in_bounded_time(page, source):
    """Deep nesting and unmatched delimiters: a bounded stack (nesting past 12 levels is text), under a second."""
    took = page.evaluate("src => { const t = performance.now(); renderMarkdown(src); return performance.now() - t; }",
                         source)
    assert took < 1000, f"{took:.0f} ms"
