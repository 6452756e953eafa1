"""``python -m gpuptr.bench``: the bench on its own (see
:func:`gpuptr.bench.main`)."""

from gpuptr.bench.command import main

if __name__ == "__main__":
    raise SystemExit(main())
