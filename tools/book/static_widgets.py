"""A widget on a page without a kernel: its saved state drawn as static HTML.

nbclient keeps every widget model's state in the executed notebook (``store_widget_state``),
Output widgets included with what they captured. A widget's output cell holds only a view
(``application/vnd.jupyter.widget-view+json``, a model id) that needs a live kernel or the
widget JavaScript from a CDN; here the view is replaced by the widget as it stood when the page
was built: its controls and their values, its HTML, its figures, and one line saying how to
move it live.
"""

from __future__ import annotations

import html
from typing import Any

import nbformat

VIEW = "application/vnd.jupyter.widget-view+json"
STATE = "application/vnd.jupyter.widget-state+json"
BOXES = {"VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel", "TabModel", "AccordionModel",
         "StackModel"}  # fmt: skip
SELECTIONS = {"DropdownModel", "ToggleButtonsModel", "RadioButtonsModel", "SelectModel",
              "SelectionSliderModel"}  # fmt: skip


def _ref(value: str) -> str:
    return value.removeprefix("IPY_MODEL_")


def _output_html(out: dict[str, Any]) -> tuple[str, int]:
    """One captured output as HTML, and how many figures it holds."""
    if out.get("output_type") == "stream":
        return f"<pre>{html.escape(out.get('text', ''))}</pre>", 0
    data = out.get("data", {})
    if "image/png" in data:
        return f'<img alt="figure" src="data:image/png;base64,{data["image/png"].strip()}"/>', 1
    if "text/html" in data:
        return str(data["text/html"]), 0
    if "text/plain" in data:
        return f"<pre>{html.escape(str(data['text/plain']))}</pre>", 0
    return "", 0


def _control(name: str, s: dict[str, Any]) -> str | None:
    """``description: value`` for a control, or None for what is not a control."""
    if name in SELECTIONS:
        labels, index = s.get("_options_labels", []), s.get("index")
        value: Any = labels[index] if isinstance(index, int) and index < len(labels) else ""
    elif "value" in s and name not in {"HTMLModel", "HTMLMathModel", "LabelModel"}:
        value = s["value"]
    else:
        return None
    label = s.get("description") or name.removesuffix("Model")
    return f"<b>{html.escape(str(label))}</b>: {html.escape(str(value))}"


def render(model_id: str, state: dict[str, Any], depth: int = 0) -> tuple[str, int]:
    """HTML for the model ``model_id`` and its children, and the figures it holds."""
    model = state.get(model_id)
    if model is None or depth > 20:
        return "", 0
    name, s = model.get("model_name", ""), model.get("state", {})
    if name in BOXES:
        parts = [render(_ref(c), state, depth + 1) for c in s.get("children", [])]
        direction = "row" if name == "HBoxModel" else "column"
        body = "".join(p for p, _ in parts)
        style = f"display:flex;flex-direction:{direction};flex-wrap:wrap;gap:0.3em 1.2em"
        return f'<div style="{style}">{body}</div>', sum(n for _, n in parts)
    if name == "OutputModel":
        parts = [_output_html(o) for o in s.get("outputs", [])]
        return "".join(p for p, _ in parts), sum(n for _, n in parts)
    if name in {"HTMLModel", "HTMLMathModel"}:
        return f"<div>{s.get('value', '')}</div>", 0
    if name == "LabelModel":
        return f"<div>{html.escape(str(s.get('value', '')))}</div>", 0
    control = _control(name, s)
    return (f"<span>{control}</span>", 0) if control else ("", 0)


def snapshot(model_id: str, state: dict[str, Any], live: str) -> tuple[str, int]:
    """The widget as a static block, with the line that says how to move it live."""
    body, figures = render(model_id, state)
    if not body.strip():
        body = ("<p><i>This widget showed nothing when the page was built (its state was not "
                "saved); run the notebook to see it.</i></p>")  # fmt: skip
    note = ("<p class='labkit-widget-note'><small>A widget, shown as it stood when this page "
            f"was built. To move it live: <code>{html.escape(live)}</code></small></p>")
    style = "border:1px solid #ccc;border-radius:4px;padding:0.5em;margin:0.5em 0"
    return f'<div class="labkit-widget-snapshot" style="{style}">{note}{body}</div>', figures


def freeze(nb: Any, live: str) -> int:
    """Replace every widget view in ``nb`` (in place) by its static snapshot; return how many."""
    state = nb.metadata.get("widgets", {}).get(STATE, {}).get("state", {})
    count = 0
    for cell in nb.cells:
        for i, out in enumerate(cell.get("outputs", [])):
            view = out.get("data", {}).get(VIEW)
            if view is None:
                continue
            block, _ = snapshot(view["model_id"], state, live)
            cell.outputs[i] = nbformat.v4.new_output("display_data", {"text/html": block})
            count += 1
    return count


def figures_in(nb: Any) -> int:
    """Figures an executed notebook holds: image outputs, and images inside widget views."""
    state = nb.metadata.get("widgets", {}).get(STATE, {}).get("state", {})
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            n += "image/png" in data or "image/svg+xml" in data
            if VIEW in data:
                n += render(data[VIEW]["model_id"], state)[1]
    return n
