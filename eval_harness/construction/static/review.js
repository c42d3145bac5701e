// The review page: every proposed item as a card; each decision (accept, reject, a span edited, removed or
// added) is POSTed at once and the card redrawn from the server's reply, so what is shown is what is saved.
"use strict";

const items = new Map();  // id -> the item as the server last returned it
let saves = 0;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setSaved(state, text) {
  const saved = document.getElementById("saved");
  saved.dataset.state = state;
  saved.dataset.saves = String(saves);
  saved.textContent = text;
}

function updateCounts(counts) {
  for (const status of ["pending", "accepted", "rejected"]) {
    document.getElementById(`count-${status}`).textContent = counts[status];
  }
}

async function decide(id, status, spans) {
  const card = document.querySelector(`.card[data-id="${CSS.escape(id)}"]`);
  setSaved("saving", `saving ${id}...`);
  let reply;
  try {
    const response = await fetch(`/api/items/${encodeURIComponent(id)}`, {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({status, spans}),
    });
    reply = await response.json();
    if (!response.ok) throw new Error(reply.error || `HTTP ${response.status}`);
  } catch (error) {
    const fresh = render(items.get(id));  // back to what is saved
    fresh.querySelector(".error").textContent = error.message;
    card.replaceWith(fresh);
    setSaved("error", `not saved: ${error.message}`);
    return;
  }
  items.set(id, reply.item);
  card.replaceWith(render(reply.item));
  updateCounts(reply.counts);
  saves += 1;
  setSaved("saved", `saved ${id} (${reply.item.status}, ${reply.item.spans.length} spans) at ` +
           new Date().toLocaleTimeString());
  applyFilter();
}

function render(item) {
  const card = document.getElementById("card").content.firstElementChild.cloneNode(true);
  card.dataset.id = item.id;
  card.dataset.status = item.status;
  card.querySelector(".item-id").textContent = item.id;
  const badge = card.querySelector(".status");
  badge.textContent = {pending: "to review", accepted: "accepted", rejected: "rejected"}[item.status];
  badge.classList.add(item.status);
  card.querySelector(".public-query").textContent = item.public_query;
  const options = card.querySelector(".options");
  for (const [letter, text] of Object.entries(item.options)) {
    const li = el("li", letter === item.answer_idx ? "correct" : "", text);
    li.value = letter.charCodeAt(0) - 64;
    options.append(li);
  }
  const context = card.querySelector(".private-context");
  for (const segment of item.segments) {
    if (segment.span === null) {
      context.append(document.createTextNode(segment.text));
    } else {
      const mark = el("mark", "span", segment.text);
      mark.dataset.span = String(segment.span);
      mark.title = `span ${segment.span + 1}`;
      context.append(mark);
    }
  }
  const list = card.querySelector(".spans");
  item.spans.forEach((span, index) => {
    const li = el("li");
    const input = el("input");
    input.type = "text";
    input.value = span;
    input.className = "span-text";
    input.setAttribute("aria-label", `span ${index + 1}`);
    input.addEventListener("change", () => {
      const spans = [...item.spans];
      spans[index] = input.value.trim();
      decide(item.id, item.status, spans.filter((s) => s));
    });
    const remove = el("button", "remove", "\u00d7");
    remove.type = "button";
    remove.title = "remove this span";
    remove.addEventListener("click", () => decide(item.id, item.status, item.spans.filter((_, i) => i !== index)));
    li.append(input, remove);
    list.append(li);
  });
  const add = (text) => {
    text = text.trim();
    if (!text) return;
    decide(item.id, item.status, [...item.spans, text]);
  };
  card.querySelector(".add-selection").addEventListener("click", () => {
    const selection = window.getSelection();
    if (!selection.rangeCount || !context.contains(selection.getRangeAt(0).commonAncestorContainer)) {
      card.querySelector(".error").textContent = "select some text of this item's private context first";
      return;
    }
    add(selection.toString());
  });
  const typed = card.querySelector(".new-span");
  card.querySelector(".add-typed").addEventListener("click", () => add(typed.value));
  typed.addEventListener("keydown", (event) => { if (event.key === "Enter") add(typed.value); });
  const accept = card.querySelector(".accept"), reject = card.querySelector(".reject");
  accept.disabled = item.status === "accepted";
  reject.disabled = item.status === "rejected";
  accept.addEventListener("click", () => decide(item.id, "accepted", item.spans));
  reject.addEventListener("click", () => decide(item.id, "rejected", item.spans));
  const undecide = card.querySelector(".undecide");
  undecide.hidden = item.status === "pending";
  undecide.addEventListener("click", () => decide(item.id, "pending", item.spans));
  card.querySelector(".rationale").textContent = item.judge_rationale ?
    `Rationale: ${item.judge_rationale}` : "No rationale.";
  const dropped = card.querySelector(".dropped");
  for (const d of item.dropped) dropped.append(el("li", "", `${d.span} (${d.reason})`));
  if (!item.dropped.length) dropped.append(el("li", "kept-all", "No proposed span was dropped."));
  return card;
}

function applyFilter() {
  const wanted = document.getElementById("filter").value;
  for (const card of document.querySelectorAll(".card")) {
    card.hidden = wanted !== "all" && card.dataset.status !== wanted;
  }
}

async function load() {
  const response = await fetch("/api/items");
  const data = await response.json();
  document.getElementById("build").textContent = `${data.directory}: ${data.items.length} items proposed by the judge`;
  const list = document.getElementById("items");
  list.replaceChildren();
  for (const item of data.items) {
    items.set(item.id, item);
    list.append(render(item));
  }
  updateCounts(data.counts);
  document.getElementById("filter").addEventListener("change", applyFilter);
  setSaved("ready", "every decision is saved as you make it");
}

load().catch((error) => setSaved("error", `cannot load the items: ${error.message}`));
