"""What the scripts in scripts/hopper/ share: timing on the GPU or the CPU, and their
records printed as JSON lines (and written to a file with `--json`) for the tables."""

import json
import time

import torch


class Timer:
    """Mean seconds of `fn` over `reps` calls after `warm` calls: CUDA events on the GPU,
    the wall clock on the CPU."""

    def __init__(self, device, warm, reps):
        self.device, self.warm, self.reps = device, warm, reps

    def __call__(self, fn):
        for _ in range(self.warm):
            fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / self.reps
        t = time.perf_counter()
        for _ in range(self.reps):
            fn()
        return (time.perf_counter() - t) / self.reps


class Records:
    """Records kept for the closing table, each printed as a JSON line as it comes and
    written to `path` too when one is given."""

    def __init__(self, path):
        self.rows = []
        self.sink = open(path, "w") if path else None

    def emit(self, rec):
        self.rows.append(rec)
        line = json.dumps(rec)
        print(line, flush=True)
        if self.sink:
            self.sink.write(line + "\n")
            self.sink.flush()

    def table(self, columns, text_columns, cells, keys=(), failed="failed"):
        """The records as a Markdown table: `columns` headers, the first `text_columns` of
        them left-aligned; `cells(record)` gives a row's cells. A record with an "error"
        shows its `keys` fields and `failed: <error>` instead."""
        print("\n| " + " | ".join(columns) + " |")
        print("|" + "|".join("---" if i < text_columns else "---:"
                             for i in range(len(columns))) + "|")
        for r in self.rows:
            if "error" in r:
                row = [str(r[k]) for k in keys] + [f"{failed}: {r['error'][:60]}"]
                row += [""] * (len(columns) - len(row))
            else:
                row = cells(r)
            print("| " + " | ".join(row) + " |")

