"""The Python SDK's SLM rows for the TypeScript end-to-end tests: LlamaCppSLM (llama-cpp-python) on a GGUF, a
prefill of the given ids then greedy appends, each step's logits written as float32 bytes one row after another.

    python js/test/e2e/python_rows.py --gguf PATH --ids 2,651,... --appends 3 --threads 1 --out rows.f32
"""

from __future__ import annotations

import argparse

import numpy as np

from edge_sdk.backends.llama_cpp import LlamaCppSLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="the model file")
    parser.add_argument("--ids", required=True, help="the prompt's token ids, comma-separated")
    parser.add_argument("--appends", type=int, default=3, help="greedy tokens appended after the prefill")
    parser.add_argument("--threads", type=int, default=None, help="decode threads (default: LlamaCppSLM's)")
    parser.add_argument("--out", required=True, help="where the float32 rows go")
    args = parser.parse_args()

    slm = LlamaCppSLM(args.gguf, n_threads=args.threads)
    rows = [slm.prefill([int(i) for i in args.ids.split(",")])]
    for _ in range(args.appends):
        rows.append(slm.append(int(np.argmax(rows[-1]))))
    np.stack(rows).astype(np.float32, copy=False).tofile(args.out)
    slm.close()


if __name__ == "__main__":
    main()
