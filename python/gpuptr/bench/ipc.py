"""What one ``ipc_handle()`` costs after 100,000 exports of one buffer
(each handle dropped), against the first 1,000: the export's books must
not grow with the exports made."""

from __future__ import annotations

from gpuptr.bench._bench import Bench, Measured
from gpuptr.bench._timing import run_ns


def rows(b: Bench) -> None:
    def measure() -> Measured:
        import gpuptr

        mem = gpuptr.alloc(1 << 20)
        export = mem.ipc_handle
        first = run_ns(export, 1000)
        for _ in range(98_000):
            export()
        late = min(run_ns(export, 1000) for _ in range(2))
        return Measured(late, first)

    name = "ipc_handle() per export, after 100,000 exports of one buffer"
    b.measure(name, "the first 1,000 exports", measure, labels=("ipc",), say=name)
