// The live page: ask through this endpoint's own OpenAI API (streaming), colour every token by how many values
// left the device at its step (its outline by what kind of thing the cloud saw), raise the leakage meter, say
// why it rose, and fill the ledger.  Plain browser JavaScript: no build step, no
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

// the most values that left the device at a step for each colour band, left-0 .. left-4 (the legend's words)
const LEFT_BAND_MOST = [0, 1, 100, 10000, Infinity];

function leftBand(values) {
  return LEFT_BAND_MOST.findIndex((most) => values <= most);
}

const NUMBER = new Intl.NumberFormat("en-US");
const count = (n) => NUMBER.format(n);

// 950 -> "950 B", 12,800 -> "12.5 KB", 3,500,000 -> "3.3 MB" (1 KB = 1,024 B)
function bytes(n) {
  if (n < 1024) return `${count(n)} B`;
  const [value, unit] = n < 1024 * 1024 ? [n / 1024, "KB"] : [n / (1024 * 1024), "MB"];
  return `${count(Number(value.toFixed(1)))} ${unit}`;
}

const $ = (id) => document.getElementById(id);
let modelName = "coveil";
let meterExplained = false; // whether the line saying why the meter rose is written

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
    const runContext = info.run_private_context;
    $("model-info").textContent =
      `model "${info.model}": ${info.edge_model} on this device; chat template: ${info.chat_template}` +
      (runContext ? `; a request without a private context of its own is conditioned on ${runContext.file} ` +
                    `(${runContext.characters} characters, read at start; it stays on this device)` : "");
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
  $("meter-why").textContent = "";
  meterExplained = false;
  showMeter(0);
}

// why the meter rose, said once, at the first step that raised it
function explainMeter(step) {
  if (meterExplained || step.leakage_meter <= 0) return;
  meterExplained = true;
  // edge-side the meter reads the cloud's own top ids for the step (E_t^K), not the token the device sent: the
  // token itself need not be a word of the private context, so it is not named
  const what = step.saw === "upload" || step.saw === "nothing"
    ? `the upload at step ${step.step} ranks a word of the private context among its top ids`
    : `at step ${step.step} the cloud's own top next tokens, after the text the device chose so far, include a ` +
      "word of the private context";
  $("meter-why").textContent = `The meter rose to ${percent(step.leakage_meter)}: ${what}. A word counts as ` +
    "exposed whenever the private context holds it, even when the public question says it too (the cloud " +
    "cannot tell which one taught the answer the word, so the meter does not either).";
}

// the line under the meter: the epsilon the generation spent, or that its policy has no DP guarantee
// (what that means to the person next to it; a source's weaker figure second, labelled)
function epsilonLine(privacy) {
  if (!privacy) return "";
  const withheld = privacy.withheld_reason ? "; " + privacy.withheld_reason : "";
  if (privacy.guarantee !== "dp") return `ε: non-private (${privacy.note})${withheld}. ${privacy.in_words}`;
  const source = privacy.source_relation ?
    `; for ${privacy.source_relation.relation}: ${privacy.source_relation.epsilon_spent.toPrecision(4)}` : "";
  return `ε spent: ${privacy.epsilon_spent.toPrecision(4)} at δ = ${privacy.delta} for ${privacy.relation}, over ` +
    `${privacy.events} releases (${privacy.accountant})${source}${withheld}. In words: ${privacy.in_words}`;
}

// the activity log (/v1/coveil/activity, with the key) downloaded as coveil-activity.json
async function exportActivity() {
  try {
    const response = await fetch("/v1/coveil/activity", { headers: headers() });
    if (!response.ok) {
      const failure = await response.json().catch(() => ({}));
      throw new Error(`${response.status}: ${failure.error ? failure.error.message : response.statusText}`);
    }
    const link = document.createElement("a");
    link.href = URL.createObjectURL(await response.blob());
    link.download = "coveil-activity.json";
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 60000);
  } catch (error) {
    setStatus("cannot export the activity log: " + error.message, "error");
  }
}

function showMeter(share) {
  $("meter-fill").style.width = percent(share);
  $("meter-value").textContent = percent(share);
  $("meter").setAttribute("aria-valuenow", (100 * share).toFixed(1));
}

// a ledger row: one cell per value, as text; a number is shown readable and kept exact in data-value
function tableRow(values) {
  const row = document.createElement("tr");
  for (const value of values) {
    const td = document.createElement("td");
    if (typeof value === "object") {
      td.textContent = value.text;
      td.dataset.value = value.exact;
      td.title = `${count(value.exact)}${value.unit || ""}`;
    } else {
      td.textContent = value;
    }
    row.append(td);
  }
  return row;
}

const valuesCell = (n) => ({ text: count(n), exact: n });
const bytesCell = (n) => ({ text: bytes(n), exact: n, unit: " bytes" });

// what the cloud saw at one step, in words ("an upload of 3 values")
function sawText(step) {
  if (step.saw === "upload") return `an upload of ${count(step.values_uploaded)} value${step.values_uploaded === 1 ? "" : "s"}`;
  return SAW_LABELS[step.saw];
}

function addStep(text, step) {
  const band = "left-" + leftBand(step.values_left);
  const span = document.createElement("span");
  span.className = `tok saw-${step.saw} ${band}`;
  span.textContent = text;
  span.dataset.step = step.step;
  span.dataset.saw = step.saw;
  span.dataset.valuesLeft = step.values_left;
  span.title = `step ${step.step}: the cloud saw ${sawText(step)}` +
    (step.withheld ? "; exposure budget spent: a cloud-only signal" : "") +
    `; ${count(step.values_left)} value${step.values_left === 1 ? "" : "s"} left the device; ` +
    `${bytes(step.bytes_up)} up, ${bytes(step.bytes_down)} down`;
  $("answer").append(span);

  const row = tableRow([step.step, JSON.stringify(text).slice(1, -1), sawText(step) + (step.withheld ? " (budget spent)" : ""),
    valuesCell(step.values_uploaded), bytesCell(step.bytes_up), bytesCell(step.bytes_down), percent(step.leakage_meter)]);
  row.className = band;
  document.querySelector("#ledger tbody").append(row);
  explainMeter(step);
  showMeter(step.leakage_meter);
}

// the policy as the summary row names it: a DP policy by what one release costs for the ledger's relation, as the
// ledger states it (its parameters' "epsilon=2.0" beside the epsilon spent would read as the generation's)
function policyLabel(ledger) {
  const privacy = ledger.privacy;
  if (!privacy || privacy.guarantee !== "dp") return ledger.policy;
  return `${ledger.policy.split("(")[0]} (each of ${privacy.events} releases: ${privacy.event} for ` +
    `${privacy.relation}; the generation's ε below)`;
}

function addSummary(ledger, finishReason) {
  const row = tableRow([ledger.steps + " steps", "finish: " + finishReason,
    `${ledger.mode}-side ${policyLabel(ledger)}; ${count(ledger.full_requests)} full requests`,
    valuesCell(ledger.values_uploaded), bytesCell(ledger.bytes_up), bytesCell(ledger.bytes_down),
    percent(ledger.leakage_meter)]);
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
  if ($("max-epsilon").value !== "") body.coveil.max_epsilon = Number($("max-epsilon").value);
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
$("export").addEventListener("click", exportActivity);
$("api-key").addEventListener("change", loadInfo);
// opened as /?key=KEY (a keyed endpoint): the key fills its field and leaves the address bar and the history
const pageKey = new URLSearchParams(location.search).get("key");
if (pageKey) {
  $("api-key").value = pageKey;
  history.replaceState(null, "", "/");
}
addSamples();
loadInfo();
