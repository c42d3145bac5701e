"""Quantised edge model vs its full-precision reference (``decodeleak compare-quant``).

:mod:`~eval_harness.compare.quantize` derives and caches quantised variants of a GGUF with llama.cpp's own
quantiser and reads what each file holds; :mod:`~eval_harness.compare.drift` is the per-step comparison
(pure numpy: KL, top-K overlap, CoVeil's decisions); :mod:`~eval_harness.compare.teacher` runs the models
along one shared prefix.  The table and the figure are :mod:`eval_harness.report.quant` (rows only).
"""
