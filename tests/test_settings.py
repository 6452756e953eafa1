"""Sizes and switches in settings and arguments, install hints for missing
extras, and the memory as a context manager (what a newcomer meets in
the first hour)."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import gpuptr
from helpers import hide_modules

DRIVER = gpuptr.driver_info()["driver"]
sim = pytest.mark.skipif(DRIVER != "sim", reason="the simulator's device size is known")


def _child(code, **env):
    e = dict(os.environ, GPUPTR_DRIVER="sim")
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True, timeout=120)


@pytest.fixture
def no_limit():
    yield
    gpuptr.set_pool_limit(None)


@sim
def test_pool_limits_take_every_size_users_write(no_limit):
    total = gpuptr.context(0).get_memory_info()[1]
    for given, bytes_ in [
        (1 << 29, 1 << 29),
        ("512MiB", 512 << 20),
        ("500M", 500_000_000),
        ("0.5GB", 500_000_000),
        (0.25, total // 4),
        ("25%", total // 4),
        ("1.0", total),
    ]:
        gpuptr.set_pool_limit(given, device=0)
        assert gpuptr.stats()[0]["pool_limit"] == bytes_, given
    gpuptr.set_pool_limit(None)
    assert gpuptr.stats()[0]["pool_limit"] is None


@sim
@pytest.mark.parametrize("bad", ["banana", "40XB", "0%", "120%", 1.5, 0.0, -1.0, "-5"])
def test_a_bad_size_names_the_argument(bad, no_limit):
    with pytest.raises(gpuptr.InvalidArgumentError, match="nbytes"):
        gpuptr.set_pool_limit(bad)
    with pytest.raises(gpuptr.InvalidArgumentError, match="nbytes"):
        gpuptr.reserve(bad)


@sim
@pytest.mark.parametrize("big", ["18446744073709551615", "9223372036854775808", 2**63, 2**64 - 1, "8EiB"])
def test_a_size_past_2_63_bytes_is_refused_as_string_and_as_int(big, no_limit):
    # One rule for every form: at most 2**63-1 bytes; never "no limit".
    with pytest.raises(gpuptr.InvalidArgumentError, match="nbytes"):
        gpuptr.set_pool_limit(big)
    assert gpuptr.stats()[0]["pool_limit"] is None


@sim
@pytest.mark.parametrize("what", ["nbytes", "block_size"])
def test_a_size_string_with_a_lone_surrogate_is_a_typed_error(what, no_limit):
    # It raised UnicodeEncodeError, no gpuptr error.
    calls = [gpuptr.set_pool_limit, gpuptr.reserve] if what == "nbytes" else [lambda s: gpuptr.reserve(0, block_size=s)]
    for call in calls:
        with pytest.raises(gpuptr.InvalidArgumentError, match=f"{what}=.* is not a size"):
            call("1\ud800GB")
    assert gpuptr.stats()[0]["pool_limit"] is None


@sim
def test_a_share_of_less_than_one_byte_is_refused_not_a_zero_limit(no_limit):
    with pytest.raises(gpuptr.InvalidArgumentError, match="less than one byte"):
        gpuptr.set_pool_limit(1e-12)
    assert gpuptr.stats()[0]["pool_limit"] is None
    with pytest.raises(gpuptr.InvalidArgumentError, match="less than one byte"):
        gpuptr.reserve(1e-15)


@sim
def test_numpy_scalar_sizes_read_as_the_python_ones(no_limit):
    np = pytest.importorskip("numpy")
    total = gpuptr.context(0).get_memory_info()[1]
    for given, want in [
        (np.float32(0.25), int(total * float(np.float32(0.25)))),
        (np.float64(0.5), total // 2),
        (np.int64(1 << 20), 1 << 20),
        (np.uint32(4096), 4096),
    ]:
        gpuptr.set_pool_limit(given, device=0)
        assert gpuptr.stats()[0]["pool_limit"] == want, repr(given)
    with pytest.raises(gpuptr.InvalidArgumentError, match="nbytes"):
        gpuptr.set_pool_limit(np.float32(1.5))


def test_a_bool_is_not_a_size():
    with pytest.raises(TypeError):
        gpuptr.set_pool_limit(True)


@sim
@pytest.mark.parametrize("kind", ["bool", "complex"])
def test_numpy_bools_and_complex_numbers_are_not_sizes_as_a_bool_is_not(kind, no_limit):
    # np.True_ is no int and has __float__: it read as a share of 1.0 (the
    # whole device), and a complex number as its real part.
    np = pytest.importorskip("numpy")
    given = {
        "bool": [True, np.True_, np.False_, np.bool_(True)],
        "complex": [0.5 + 0j, 0.5j, np.complex64(0.5), np.complex128(0.5), np.clongdouble(0.5)],
    }[kind]
    for value in given:
        for call in (
            lambda: gpuptr.set_pool_limit(value),
            lambda: gpuptr.reserve(value),
            lambda: gpuptr.reserve(1 << 20, block_size=value),
        ):
            with pytest.raises(TypeError, match=kind) as e:
                call()
            assert not isinstance(e.value, gpuptr.GpuptrError), repr(value)
        assert gpuptr.stats()[0]["pool_limit"] is None, repr(value)


@sim
def test_a_reservation_past_the_free_memory_is_refused_whole():
    free0, total = gpuptr.context(0).get_memory_info()
    held0 = gpuptr.stats()[0]["pool_bytes"]
    with pytest.raises(gpuptr.OutOfMemoryError, match="free of") as ei:
        gpuptr.reserve(2 * total)
    assert isinstance(ei.value, MemoryError)
    assert gpuptr.stats()[0]["pool_bytes"] == held0, "nothing was taken"
    # A block larger than the device is what cannot fit: the message named
    # the reservation's 1 MiB.
    with pytest.raises(gpuptr.OutOfMemoryError, match=r"could not allocate \S+ [MG]iB .*in blocks of") as ei:
        gpuptr.reserve(1 << 20, block_size=2 * total)
    assert ei.value.args and "1.00 MiB" not in str(ei.value), ei.value
    assert gpuptr.stats()[0]["pool_bytes"] == held0, "nothing was taken"
    assert gpuptr.reserve(0, block_size=2 * total) == 0, "a reservation of nothing needs no block"
    got = gpuptr.reserve("10%", block_size="1MiB")
    assert 0 < got <= free0 // 10 + (1 << 20)
    gpuptr.trim()


def test_a_pool_limit_without_a_pool_is_refused_not_ignored():
    # GPUPTR_POOL=0 sends allocations to the driver: a limit had nothing to
    # cap, and a 64 MiB allocation went through a 1 MiB "limit" silently.
    r = _child(
        """
        import gpuptr
        try:
            gpuptr.set_pool_limit(1 << 20)
        except gpuptr.InvalidArgumentError as e:
            print("refused:", e)
        gpuptr.set_pool_limit(None)  # no cap: nothing to do, no error
        print("limit", gpuptr.stats()[0]["pool_limit"], "allocated", gpuptr.alloc(64 << 20).size)
        """,
        GPUPTR_POOL="0",
    )
    assert r.returncode == 0, r.stderr
    assert "refused: invalid argument: device 0 has no pool to limit (GPUPTR_POOL=0" in r.stdout, r.stdout
    assert "limit None allocated 67108864" in r.stdout, r.stdout


def test_a_simulator_with_no_device_is_no_driver_as_cuinit_finding_none():
    r = _child(
        """
        import gpuptr
        try:
            gpuptr.alloc(10)
        except gpuptr.NoDriverError as e:
            print("NoDriverError:", e)
        """,
        GPUPTR_SIM_DEVICES="0",
    )
    assert "NoDriverError: no CUDA driver: GPUPTR_SIM_DEVICES=0" in r.stdout, (r.stdout, r.stderr)


def test_a_share_of_nothing_free_reserves_nothing():
    # With the device full, reserve("80%") said the share was "less than one
    # byte of the device's 0 bytes (give a share of at least 1/0 ...)".
    r = _child(
        """
        import gpuptr
        free, total = gpuptr.context(0).get_memory_info()
        m = gpuptr.alloc(free)
        print(gpuptr.context(0).get_memory_info()[0], gpuptr.reserve("80%"), gpuptr.reserve(0.5))
        """
    )
    assert r.stdout.split() == ["0", "0", "0"], (r.stdout, r.stderr)


def test_settings_from_the_environment():
    r = _child(
        """
        import gpuptr
        print(gpuptr.context(0).get_memory_info()[1], gpuptr.tracking())
        """,
        GPUPTR_SIM_MEMORY="1G",
        GPUPTR_TRACK="yes",
        GPUPTR_POOL_AHEAD="32MiB",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(10**9), "True"]


@pytest.mark.parametrize(
    "name,value", [("GPUPTR_POOL", "banana"), ("GPUPTR_TRACK", "maybe"), ("GPUPTR_SIM_MEMORY", "lots"), ("GPUPTR_POOL_AHEAD", "50%"), ("GPUPTR_POOL_HEADROOM", "lots")]
)
def test_a_bad_setting_is_an_error_that_names_it(name, value):
    r = _child(
        """
        import gpuptr
        try:
            gpuptr.alloc(16)
        except gpuptr.InvalidArgumentError as e:
            print("refused:", e)
        """,
        **{name: value},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused:") and name in r.stdout, r.stdout


_REFUSED = """
    import gpuptr
    try:
        gpuptr.alloc(16)
        print("accepted")
    except gpuptr.InvalidArgumentError as e:
        print("refused:", e)
    """


@pytest.mark.parametrize("name", ["GPUPTR_SIM_MEMORY", "GPUPTR_POOL_AHEAD", "GPUPTR_POOL_HEADROOM", "GPUPTR_HOST_CACHE"])
def test_a_byte_size_settings_hint_names_only_what_it_takes(name):
    # These sizes are not of a device: a share is refused, so the hint for
    # a bad value must not offer one, and every form it offers is taken.
    r = _child(_REFUSED, **{name: "abc"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused:") and name in r.stdout, r.stdout
    assert "%" not in r.stdout and "0.8" not in r.stdout and "share such as" not in r.stdout, r.stdout
    hint = r.stdout.split(";", 1)[1]  # after 'NAME="abc" is not a size (why;'
    offered = re.findall(r'"([^"]+)"', hint) + re.findall(r"\((\d+)\)", hint)
    assert len(offered) >= 2, r.stdout
    for form in offered:
        ok = _child(_REFUSED, **{name: form})
        assert ok.returncode == 0 and ok.stdout.strip() == "accepted", (form, ok.stdout, ok.stderr)
    share = _child(_REFUSED, **{name: "80%"})
    assert share.stdout.startswith("refused:") and name in share.stdout and "share" in share.stdout, share.stdout


@sim
def test_reserves_block_size_hint_names_only_what_it_takes():
    with pytest.raises(gpuptr.InvalidArgumentError, match="block_size") as e:
        gpuptr.reserve(1 << 20, block_size="abc")
    assert "%" not in str(e.value) and "share such as" not in str(e.value), e.value
    with pytest.raises(gpuptr.InvalidArgumentError, match="block_size.*share"):
        gpuptr.reserve(1 << 20, block_size="50%")


def _child_bytes(code, **env):
    """`_child` with an environment of raw bytes (os.environb): a value
    that is no UTF-8 text, as a Linux environment may hold."""
    e = dict(os.environb)
    e[b"GPUPTR_DRIVER"] = b"sim"
    e.update({k.encode(): v for k, v in env.items()})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, timeout=120)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


@pytest.mark.parametrize(
    "name,value",
    [
        ("GPUPTR_POOL_AHEAD", b"32\xffMiB"),
        ("GPUPTR_HOST_CACHE", b"1\xffGiB"),
        ("GPUPTR_POOL", b"o\xffn"),
        ("GPUPTR_TRACK", b"\xff"),
        ("GPUPTR_HISTORY", b"on\xff"),
        ("GPUPTR_SIM_MEMORY", b"1\xffGiB"),
        ("GPUPTR_SIM_DEVICES", b"2\xff"),
    ],
)
def test_a_setting_that_is_no_utf8_text_is_refused_by_name_not_read_as_unset(name, value):
    rc, out, err = _child_bytes(
        """
        import gpuptr
        try:
            gpuptr.alloc(16)
            print("accepted")
        except gpuptr.InvalidArgumentError as e:
            print("refused:", e)
        """,
        **{name: value},
    )
    assert rc == 0, err
    assert out.startswith("refused:") and name in out and "UTF-8" in out, out


def test_a_driver_choice_that_is_no_utf8_text_is_refused_by_name():
    rc, out, err = _child_bytes(
        """
        import gpuptr
        try:
            gpuptr.alloc(16)
            print("accepted")
        except gpuptr.NoDriverError as e:
            print("refused:", e)
        """,
        GPUPTR_DRIVER=b"s\xffim",
    )
    assert rc == 0, err
    # Not read as unset (auto), whose own refusal on a machine without a
    # driver names GPUPTR_DRIVER too.
    assert out.startswith("refused:") and "GPUPTR_DRIVER" in out and "UTF-8" in out, out


def test_an_oom_snapshot_path_that_is_no_utf8_text_is_written_there(tmp_path):
    # A Linux path is bytes: gpuptr takes it as it is, never as unset.
    path = os.fsencode(tmp_path) + b"/oom-\xff.pickle"
    rc, out, err = _child_bytes(
        """
        import gpuptr
        gpuptr.set_pool_limit(8 << 20)
        try:
            gpuptr.alloc(64 << 20)
        except gpuptr.OutOfMemoryError as e:
            print(e)
        """,
        GPUPTR_OOM_SNAPSHOT=path,
    )
    assert rc == 0, err
    assert "a memory snapshot was written to" in out, out
    assert os.path.isfile(path), os.listdir(os.fsencode(tmp_path))




# gpuptr.numba serves numba-cuda and numba-cuda-mlir: it is missing only when both are.
@pytest.mark.parametrize("module,missing,extra", [("gpuptr.numba", "numba numba_cuda_mlir", '"numba-cuda[cu13]"'), ("gpuptr.numba", "numba numba_cuda_mlir", '"numba-cuda-mlir[cu13]"'), ("gpuptr.dask", "distributed", "distributed")])
def test_a_missing_extra_says_which_to_install(module, missing, extra):
    r = _child(hide_modules(*missing.split()) + f"import {module}\n")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    # gpuptr is on no index: the hint names what pip can find.
    assert "pip install " in last and extra in last and "gpuptr[" not in last, r.stderr[-800:]


def test_install_names_the_extra_for_numba():
    r = _child(hide_modules("numba", "numba_cuda_mlir") + "import gpuptr\nprint(gpuptr.install(cupy=False, torch=False)['numba'])\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("skipped:") and 'pip install "numba-cuda[cu13]"' in r.stdout, r.stdout


def test_errors_are_named_where_users_import_them():
    for cls in (gpuptr.GpuptrError, gpuptr.NoDriverError, gpuptr.OutOfMemoryError, gpuptr.InvalidPointerError):
        assert cls.__module__ == "gpuptr"
        assert getattr(gpuptr, cls.__name__) is cls
    import pickle

    e = pickle.loads(pickle.dumps(gpuptr.InvalidPointerError("x")))
    assert type(e) is gpuptr.InvalidPointerError


def test_memory_is_a_context_manager_that_frees_it():
    with gpuptr.alloc(4096) as m:
        assert m.nbytes == m.size == 4096
        m.memset(1)
    with pytest.raises(gpuptr.InvalidPointerError):
        m.memset(0)
    # An exception in the block passes on, and the memory is freed still.
    with pytest.raises(KeyError):
        with gpuptr.alloc(64) as n:
            raise KeyError("boom")
    with pytest.raises(gpuptr.InvalidPointerError):
        n.memset(0)
    # A view frees nothing: its allocation is someone else's.
    owner = gpuptr.alloc(256)
    with owner.view(0, 128) as v:
        assert v.nbytes == 128
    owner.memset(2)
    owner.free()


class _Index:
    """An int-like device number, as numpy's integers are (``__index__``)."""

    def __index__(self) -> int:
        return 0


@sim
def test_the_one_number_helpers_follow_the_pool():
    gpuptr.trim()
    gpuptr.reset_peak_stats()
    base = gpuptr.memory_allocated()
    m = gpuptr.alloc(3 << 20)
    assert gpuptr.memory_allocated() == base + (3 << 20) == gpuptr.memory_allocated(0)
    assert gpuptr.max_memory_allocated() >= base + (3 << 20)
    reserved = gpuptr.memory_reserved()
    assert reserved >= gpuptr.memory_allocated() and reserved == gpuptr.stats()[0]["reserved_bytes"]
    assert gpuptr.max_memory_reserved() >= gpuptr.stats()[0]["pool_bytes"]
    m.free()
    assert gpuptr.memory_allocated() == base
    assert gpuptr.max_memory_allocated() >= base + (3 << 20), "the peak stays"
    gpuptr.flush_pool()
    gpuptr.trim()
    gpuptr.reset_peak_stats()
    assert gpuptr.max_memory_reserved() == gpuptr.stats()[0]["pool_bytes"]
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.memory_allocated(99)
    helpers = (gpuptr.memory_allocated, gpuptr.max_memory_allocated, gpuptr.memory_reserved, gpuptr.max_memory_reserved)
    for helper in helpers:
        for bad in (0.9, -0.5, True, "0", b"0", "x"):  # int() took the first five as device 0
            with pytest.raises(TypeError, match="device must be an int"):
                helper(bad)
        assert helper(_Index()) == helper(0)


@sim
def test_out_of_memory_and_retries_are_counted(no_limit):
    s0 = gpuptr.stats()[0]
    gpuptr.set_pool_limit(1 << 20, device=0)
    with pytest.raises(gpuptr.OutOfMemoryError, match="its limit is 1.00 MiB"):
        gpuptr.alloc(4 << 20)
    s1 = gpuptr.stats()[0]
    assert s1["num_ooms"] == s0["num_ooms"] + 1
    assert s1["num_alloc_retries"] == s0["num_alloc_retries"] + 1


def test_the_numba_import_error_gives_its_install_hint_once():
    r = _child(hide_modules("numba", "numba_cuda_mlir") + "import gpuptr.numba\n")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: gpuptr.numba needs numba-cuda or numba-cuda-mlir"), last
    assert last.count("pip install") == 1, last
    assert "numba-cuda: " in last and "numba-cuda-mlir: " in last, "each numba's own reason"


def test_cupy_install_without_cupy_is_an_install_error_with_the_hint():
    r = _child(
        hide_modules("cupy")
        + "import gpuptr, gpuptr.cupy\n"
        + "try:\n    gpuptr.cupy.install()\n"
        + "except gpuptr.InstallError as e:\n    print(type(e).__name__, isinstance(e, ModuleNotFoundError), e)\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("InstallError False gpuptr.cupy.install() needs CuPy"), r.stdout
    assert "pip install cupy-cuda13x" in r.stdout, r.stdout


def test_dir_of_gpuptr_shows_its_api_and_no_leaked_import():
    public = [n for n in dir(gpuptr) if not n.startswith("_")]
    assert "annotations" not in public
    # Beyond __all__, only gpuptr's own submodules.
    extra = [n for n in public if n not in gpuptr.__all__]
    assert all(getattr(getattr(gpuptr, n), "__name__", "") == f"gpuptr.{n}" for n in extra), extra
