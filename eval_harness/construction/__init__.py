"""Build a private-evidence benchmark from your own multiple-choice QA data (the paper's "Construction Details").

The pipeline, one module per concern, each stage checkpointed to a JSONL file in the build directory:

* :mod:`~eval_harness.construction.sources`: a rule per source format splits each item into a public
  query with its options (what the cloud may see) and a private context (what stays on the edge);
* :mod:`~eval_harness.construction.judge`: an LLM judge behind any OpenAI-compatible endpoint **screens**
  each item (keep it only if its answer needs the private context) and **extracts** minimal private-evidence
  spans; every reply is validated (a span must occur verbatim in the private context and not in the public
  query) and what is dropped is counted by reason; the prompts are data files (``prompts/``);
* :mod:`~eval_harness.construction.pipeline`: the stages over a build directory, resumable item by item;
* :mod:`~eval_harness.construction.review`: a person's accept / edit / reject decisions, saved as made
  (a local page, :mod:`~eval_harness.construction.review_server`, or a CSV round-trip);
* :mod:`~eval_harness.construction.finalize`: the final JSONL in the MedPriv/CommPriv schema, the
  dataset-attributes table and the length-distribution figure.
"""
