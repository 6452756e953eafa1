"""The scripts the bench runs in child processes (``gpuptr.bench._child``),
one file each: run by path with their arguments on the command line, each
prints its result as its last line of output. A child process is needed
where a library picks its allocator once per process (numba's memory
manager, CuPy's and PyTorch's allocators), or where a row needs a process
that holds no CUDA context yet."""
