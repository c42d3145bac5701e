// The live page: ask through this endpoint's own OpenAI API (streaming), colour every token by what the cloud
// saw at its step, raise the leakage meter, and fill the ledger.  Plain browser JavaScript: no build step, no
// network beyond this endpoint.
"use strict";

const SAW_LABELS = {
  nothing: "nothing",
  token: "the synchronised token",
  upload: "an upload of k values",
  full: "a full-distribution request",
};

// sample private contexts (made up) with a public question each
const SAMPLES = [
  {
    name: "clinic note",
    question: "Which organ is most likely affected, and what test would confirm it?",
    context: "Patient Maria Keller, 54, presents with jaundice, a swollen liver and raised bilirubin after " +
      "twenty years of heavy alcohol use. Ultrasound pending.",
  },
  {
    name: "trip plans",
    question: "What should I pack for the trip?",
    context: "Flying to Reykjavik on 14 March with my daughter Lena for a glacier hike; she has a peanut allergy " +
      "and we stay at a guesthouse without a kitchen.",
  },
];

const $ = (id) => document.getElementById(id);
let modelName = "coveil";

function setStatus(text, state) {
  const status = $("status");
  status.textContent = text;
  status.dataset.state = state;
}

function percent(share) {
  return (100 * share).toFixed(1) + "%";
}

// "lam=1.0, k=50" -> {lam: 1.0, k: 50}
function parseParams(text) {
  const params = {};
  for (const part of text.split(/[,\s]+/).filter(Boolean)) {
    const eq = part.indexOf("=");
    if (eq < 1) throw new Error(`parameter '${part}' is not name=value`);
    const name = part.slice(0, eq), raw = part.slice(eq + 1);
    const number = Number(raw);
    params[name] = raw === "true" ? true : raw === "false" ? false : raw !== "" && !Number.isNaN(number) ? number : raw;
  }
  return params;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function addSamples() {
  for (const sample of SAMPLES) {
    const option = document.createElement("option");
    option.value = sample.name;
    option.textContent = sample.name;
    $("sample").append(option);
  }
}

// the served model, its policies and defaults; run again once an API key is typed (a keyed endpoint refuses
// /coveil/info without it)
async function loadInfo() {
  try {
    const response = await fetch("/coveil/info", { headers: headers() });
    const info = await response.json();
    if (!response.ok) throw new Error(info.error ? info.error.message : response.statusText);
    modelName = info.model;
    $("model-info").textContent =
      `model "${info.model}": ${info.edge_model} on this device; chat template: ${info.chat_template}`;
    $("policy").replaceChildren();
    for (const name of info.policies) {
      const option = document.createElement("option");
      option.value = option.textContent = name;
      $("policy").append(option);
    }
    $("policy").value = info.defaults.policy;
    $("mode").value = info.defaults.mode;
    $("api-key-label").hidden = !info.api_key_required;
    $("params").value = info.defaults.policy === "coveil" ? "lam=1.0" : "";
  } catch (error) {
    $("model-info").textContent = "cannot read /coveil/info: " + error.message;
    $("api-key-label").hidden = false;
  }
}

function resetOutput() {
  $("answer").replaceChildren();
  document.querySelector("#ledger tbody").replaceChildren();
  document.querySelector("#ledger tfoot").replaceChildren();
  $("epsilon-line").textContent = "";
  showMeter(0);
}

// the line under the meter: the epsilon the generation spent, or that its policy has no DP guarantee
function epsilonLine(privacy) {
  if (!privacy) return "";
  const withheld = privacy.withheld_reason ? "; " + privacy.withheld_reason : "";
  if (privacy.guarantee !== "dp") return `ε: non-private (${privacy.note})${withheld}`;
  return `ε spent: ${privacy.epsilon_spent.toPrecision(4)} at δ = ${privacy.delta} over ${privacy.events} ` +
    `releases (${privacy.accountant})${withheld}`;
}

function showMeter(share) {
  $("meter-fill").style.width = percent(share);
  $("meter-value").textContent = percent(share);
  $("meter").setAttribute("aria-valuenow", (100 * share).toFixed(1));
}

// a ledger row: one cell per value, as text
function tableRow(values) {
  const row = document.createElement("tr");
  for (const value of values) {
    const td = document.createElement("td");
    td.textContent = value;
    row.append(td);
  }
  return row;
}

// what the cloud saw at one step, in words ("an upload of 3 values")
function sawText(step) {
  if (step.saw === "upload") return `an upload of ${step.values_uploaded} value${step.values_uploaded === 1 ? "" : "s"}`;
  return SAW_LABELS[step.saw];
}

function addStep(text, step) {
  const span = document.createElement("span");
  span.className = "tok saw-" + step.saw;
  span.textContent = text;
  span.dataset.step = step.step;
  span.dataset.saw = step.saw;
  span.title = `step ${step.step}: the cloud saw ${sawText(step)}` +
    (step.withheld ? "; exposure budget spent: a cloud-only signal" : "") +
    `; ${step.bytes_up} B up, ${step.bytes_down} B down`;
  $("answer").append(span);

  const row = tableRow([step.step, JSON.stringify(text).slice(1, -1), sawText(step) + (step.withheld ? " (budget spent)" : ""),
    step.values_uploaded, step.bytes_up, step.bytes_down, percent(step.leakage_meter)]);
  row.className = "saw-" + step.saw;
  document.querySelector("#ledger tbody").append(row);
  showMeter(step.leakage_meter);
}

function addSummary(ledger, finishReason) {
  const row = tableRow([ledger.steps + " steps", "finish: " + finishReason,
    `${ledger.mode}-side ${ledger.policy}; ${ledger.full_requests} full requests`, ledger.values_uploaded,
    ledger.bytes_up, ledger.bytes_down, percent(ledger.leakage_meter)]);
  document.querySelector("#ledger tfoot").replaceChildren(row);
  showMeter(ledger.leakage_meter);
  $("epsilon-line").textContent = epsilonLine(ledger.privacy);
}

// Server-sent events: "data: {json}" blocks separated by a blank line, ending with "data: [DONE]".
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function ask(event) {
  event.preventDefault();
  let params;
  try {
    params = parseParams($("params").value);
  } catch (error) {
    setStatus(error.message, "error");
    return;
  }
  const body = {
    model: modelName,
    messages: [{ role: "user", content: $("question").value }],
    stream: true,
    max_tokens: Number($("max-tokens").value) || 48,
    coveil: { private_context: $("private-context").value, mode: $("mode").value, policy: $("policy").value, params },
  };
  resetOutput();
  $("submit").disabled = true;
  setStatus("decoding...", "running");
  const started = performance.now();
  let steps = 0;
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!response.ok) {
      const failure = await response.json().catch(() => ({}));
      throw new Error(`${response.status}: ${failure.error ? failure.error.message : response.statusText}`);
    }
    let finished = false;
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      const text = choice && choice.delta.content ? choice.delta.content : "";
      const extension = chunk.coveil || {};
      if (extension.step) {
        addStep(text, extension.step);
        steps += 1;
      } else if (text) {
        $("answer").append(document.createTextNode(text));
      }
      if (extension.ledger) {
        addSummary(extension.ledger, choice.finish_reason);
        finished = true;
      }
    }
    if (!finished) throw new Error("the stream ended without its ledger");
    const seconds = (performance.now() - started) / 1000;
    setStatus(`done: ${steps} tokens in ${seconds.toFixed(1)} s`, "done");
  } catch (error) {
    setStatus(error.message, "error");
  } finally {
    $("submit").disabled = false;
  }
}

$("sample").addEventListener("change", () => {
  const sample = SAMPLES.find((s) => s.name === $("sample").value);
  if (sample) {
    $("question").value = sample.question;
    $("private-context").value = sample.context;
  }
});
$("policy").addEventListener("change", () => {
  $("params").value = $("policy").value === "coveil" ? "lam=1.0" : "";
});
$("ask").addEventListener("submit", ask);
$("api-key").addEventListener("change", loadInfo);
// opened as /?key=KEY (a keyed endpoint): the key fills its field and leaves the address bar and the history
const pageKey = new URLSearchParams(location.search).get("key");
if (pageKey) {
  $("api-key").value = pageKey;
  history.replaceState(null, "", "/");
}
addSamples();
loadInfo();
