"""Thin wrapper: ``python3 benches/compare.py [--quick] [--json F] [--plot F.png]``
is ``python -m gpuptr bench``. See gpuptr/bench/."""

from gpuptr.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
