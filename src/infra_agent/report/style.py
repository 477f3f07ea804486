"""The report's inline stylesheet: system fonts, no external resources, print-friendly."""

CSS = """
:root {
  --ink: #1f2328; --muted: #59636e; --line: #d1d9e0; --zebra: #f6f8fa; --bg: #ffffff;
  --green: #1a7f37; --green-bg: #dafbe1; --red: #cf222e; --red-bg: #ffebe9;
  --amber: #9a6700; --amber-bg: #fff8c5; --grey: #59636e; --grey-bg: #eff2f5; --blue: #0969da;
  --mono: ui-monospace, SFMono-Regular, "SF Mono", Menlo, Consolas, "Liberation Mono", monospace;
}
* { box-sizing: border-box; }
body { margin: 0; background: #f6f8fa; color: var(--ink);
  font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 24px 64px; }
section, header.top { background: var(--bg); border: 1px solid var(--line); border-radius: 8px;
  padding: 16px 20px; margin: 0 0 20px; }
h1 { font-size: 22px; margin: 0 0 4px; display: flex; align-items: center; gap: 10px; flex-wrap: wrap; }
h2 { font-size: 17px; margin: 0 0 12px; padding-bottom: 8px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 16px 0 8px; }
h4 { font-size: 13px; margin: 12px 0 6px; color: var(--muted); text-transform: uppercase; letter-spacing: .04em; }
a { color: var(--blue); text-decoration: none; }
a:hover { text-decoration: underline; }
code, pre, .mono { font-family: var(--mono); font-size: 12.5px; }
code { background: var(--grey-bg); padding: 1px 5px; border-radius: 4px; overflow-wrap: anywhere; }
.muted { color: var(--muted); }
.small { font-size: 12px; }
.sub { margin: 0 0 12px; color: var(--muted); }
dl.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 10px 18px; margin: 12px 0; }
dl.facts div { min-width: 0; }
dl.facts dt { font-size: 11.5px; color: var(--muted); text-transform: uppercase; letter-spacing: .04em; }
dl.facts dd { margin: 2px 0 0; font-weight: 600; overflow-wrap: anywhere; }
.message { border-left: 4px solid var(--blue); background: #ddf4ff; padding: 8px 12px; border-radius: 4px;
  white-space: pre-wrap; overflow-wrap: anywhere; }
nav.toc { margin: 12px 0 0; font-size: 13px; }
nav.toc a { margin-right: 14px; }
table { border-collapse: collapse; width: 100%; margin: 4px 0 8px; }
th, td { text-align: left; vertical-align: top; padding: 6px 10px; border-bottom: 1px solid var(--line); }
th { background: var(--zebra); font-size: 12px; color: var(--muted); text-transform: uppercase; letter-spacing: .03em;
  border-bottom: 2px solid var(--line); }
tbody tr:nth-child(even) { background: var(--zebra); }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 999px; font-size: 11.5px; font-weight: 600;
  line-height: 18px; border: 1px solid transparent; white-space: nowrap; vertical-align: baseline; }
.b-green { color: var(--green); background: var(--green-bg); border-color: #aceebb; }
.b-red { color: var(--red); background: var(--red-bg); border-color: #ffcecb; }
.b-amber { color: var(--amber); background: var(--amber-bg); border-color: #f5e0a0; }
.b-grey { color: var(--grey); background: var(--grey-bg); border-color: var(--line); }
.b-solid { color: #fff; background: var(--green); }
.arrow { color: var(--muted); margin: 0 4px; }
.ci { color: var(--muted); font-size: 12px; }
.label { display: block; color: var(--muted); font-size: 11.5px; }
table.tree td.id { white-space: nowrap; font-family: var(--mono); font-size: 12.5px; }
.glyph { color: var(--muted); font-family: var(--mono); white-space: pre; }
tr.on-path td:first-child { box-shadow: inset 4px 0 0 var(--green); }
table.tree tbody tr.on-path { background: #effbf1; }
tr.evidence td { color: #3d444d; }
.knob { display: inline-block; font-family: var(--mono); font-size: 12px; background: var(--grey-bg);
  border: 1px solid var(--line); border-radius: 4px; padding: 0 5px; margin: 1px 2px 1px 0; white-space: nowrap; }
pre { background: #f6f8fa; border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; overflow-x: auto;
  margin: 6px 0; line-height: 1.45; }
pre.diff span { display: inline-block; min-width: 100%; }
pre.diff .add { color: #116329; background: #e6ffec; }
pre.diff .del { color: #82071e; background: #ffebe9; }
pre.diff .hunk { color: #8250df; }
pre.diff .file { color: var(--ink); font-weight: 600; }
pre.error { background: var(--red-bg); border-color: #ffcecb; color: #82071e; white-space: pre-wrap; }
details > summary { cursor: pointer; color: var(--blue); font-size: 13px; margin: 4px 0; }
article.exp { border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; margin: 0 0 14px; background: #fff; }
article.exp.on-path { border-left: 5px solid var(--green); }
article.exp.evidence { border-left: 5px solid var(--line); }
article.exp.failed { border-left: 5px solid #ffcecb; }
article.exp > header .cost { margin-left: auto; color: var(--muted); font-size: 12px; }
table.vgates code { white-space: nowrap; }
article.exp > header { display: flex; gap: 8px; align-items: center; flex-wrap: wrap; margin-bottom: 6px; }
article.exp > header .eid { font-family: var(--mono); font-weight: 700; font-size: 14px; }
.statement { font-size: 15px; margin: 4px 0 10px; overflow-wrap: anywhere; }
.grid2 { display: grid; grid-template-columns: 1fr 1fr; gap: 4px 24px; }
@media (max-width: 800px) { .grid2 { grid-template-columns: 1fr; } }
dl.kv { display: grid; grid-template-columns: max-content 1fr; gap: 3px 12px; margin: 0; font-size: 13px; }
dl.kv dt { color: var(--muted); }
dl.kv dd { margin: 0; overflow-wrap: anywhere; }
ul.findings { list-style: none; padding: 0; margin: 0; }
ul.findings li { padding: 6px 0; border-bottom: 1px dashed var(--line); }
ul.findings li:last-child { border-bottom: 0; }
.next { color: var(--muted); font-style: italic; }
.plot-wrap { overflow-x: auto; }
svg.plot, svg.ratios { width: 100%; max-width: 1000px; height: auto; display: block; margin: 0 auto; }
.note { padding: 12px; background: var(--zebra); border: 1px dashed var(--line); border-radius: 6px; color: var(--muted); }
footer { color: var(--muted); font-size: 12px; text-align: center; }
@media print {
  body { background: #fff; }
  main { max-width: none; padding: 0; }
  section, header.top, article.exp { break-inside: avoid-page; border-color: #bbb; }
  details { display: block; }
  details > summary { display: none; }
  details:not([open]) > *:not(summary) { display: block; }
  nav.toc { display: none; }
}
"""
