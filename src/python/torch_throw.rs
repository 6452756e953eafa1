//! Throwing PyTorch's own exceptions from the allocation hook: a failure
//! through `c10::detail::torchCheckFail` (a `c10::Error`, `RuntimeError`
//! in Python), and out of memory as `c10::OutOfMemoryError`, built below, so that Python code catches a
//! `torch.cuda.OutOfMemoryError` (PyTorch's exception translation maps the
//! C++ type to it) and C++ code in PyTorch sees what its own allocator
//! throws.
//!
//! A pluggable allocator has no call for this, and `c10::OutOfMemoryError`
//! is thrown by an inline macro, so no exported function of `libc10` throws
//! it. It is built here from what `libc10` does export, by name (the
//! Itanium C++ ABI's mangled names, which also encode the `std::string`
//! ABI, so a PyTorch built otherwise is simply not matched):
//! - `c10::Error::Error(c10::SourceLocation, std::string)`, the
//!   constructor `c10::OutOfMemoryError` inherits (it adds no member);
//! - `vtable for c10::OutOfMemoryError` (exported by `libc10_cuda.so`,
//!   `libtorch_cuda.so` and `libtorch_python.so` in PyTorch 2.11), which
//!   gives the object its type for `dynamic_cast` and `typeid`, and leads
//!   to the two other parts: its typeinfo, which `catch` clauses match,
//!   and its complete-object destructor, which the C++ runtime calls when
//!   the exception is done with (PyTorch 2.11 exports no destructor by
//!   name: it is inline);
//!
//! and from the C++ runtime (`libstdc++`, loaded by PyTorch):
//! `__cxa_allocate_exception`, `__cxa_throw`, `operator new`, `operator
//! delete`. If any of these is missing, nothing is thrown this way and the
//! caller falls back to `c10::detail::torchCheckFail` (a `RuntimeError`).

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::OnceLock;

use pyo3::prelude::*;

/// `c10::SourceLocation`: `{const char* function; const char* file;
/// uint32_t line;}`, passed by value (in memory, as a C struct of 24 bytes).
#[repr(C)]
struct SourceLocation {
    function: *const c_char,
    file: *const c_char,
    line: u32,
}

/// `std::__cxx11::basic_string<char>` (libstdc++'s layout since GCC 5):
/// the data pointer, the length, and a 16-byte buffer that holds short
/// strings or, here, the heap capacity.
#[repr(C)]
struct CxxString {
    data: *mut c_char,
    len: usize,
    capacity_or_local: [usize; 2],
}

/// `c10::Error::Error(SourceLocation, std::string)`: `this`, the location
/// (by value) and the string (by the invisible reference the ABI passes a
/// non-trivial object with; the caller owns and destroys it).
type ErrorCtor = unsafe extern "C-unwind" fn(*mut c_void, SourceLocation, *mut CxxString);
type Dtor = unsafe extern "C" fn(*mut c_void);
type AllocException = unsafe extern "C" fn(usize) -> *mut c_void;
type Throw = unsafe extern "C-unwind" fn(*mut c_void, *const c_void, Option<Dtor>) -> !;
type New = unsafe extern "C-unwind" fn(usize) -> *mut c_void;
type Delete = unsafe extern "C" fn(*mut c_void);

/// What [`throw`] needs, found once by [`find`].
struct Thrower {
    ctor: ErrorCtor,
    dtor: Dtor,
    typeinfo: *const c_void,
    /// The vtable's address point (two words past its start).
    vtable: *const c_void,
    alloc_exception: AllocException,
    throw: Throw,
    new: New,
    delete: Delete,
}

// SAFETY: the pointers are addresses of immutable data (typeinfo, vtable)
// and functions in libraries loaded for the rest of the process.
unsafe impl Send for Thrower {}
// SAFETY: as above; nothing is written through them.
unsafe impl Sync for Thrower {}

static OOM_THROWER: OnceLock<Thrower> = OnceLock::new();

/// The complete-object constructor, then the base-object one (the same
/// code for a class with no virtual base; a library may export either).
const ERROR_CTORS: [&CStr; 2] = [
    c"_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
    c"_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
];
/// The complete-object destructor of the subclass, then of `c10::Error`.
const ERROR_DTORS: [&CStr; 2] = [c"_ZN3c1016OutOfMemoryErrorD1Ev", c"_ZN3c105ErrorD1Ev"];
const OOM_VTABLE: &CStr = c"_ZTVN3c1016OutOfMemoryErrorE";
/// `typeid(c10::OutOfMemoryError).name()`.
const OOM_NAME: &CStr = c"N3c1016OutOfMemoryErrorE";

/// The bytes given to the exception object: more than any PyTorch 2's
/// `c10::Error` takes (128 in 2.x), so the constructor never writes past it.
const OBJECT_BYTES: usize = 512;

/// Look `name` up in `handle` (or, with a null handle, in everything
/// loaded).
fn symbol(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    let handle = if handle.is_null() {
        libc::RTLD_DEFAULT
    } else {
        handle
    };
    // SAFETY: a valid handle (or RTLD_DEFAULT) and a NUL-terminated name.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Find what throwing `c10::OutOfMemoryError` needs in the loaded
/// libraries `libs` (already loaded: never loads one) and the process's
/// C++ runtime. Whether everything was found.
fn find(libs: &[std::path::PathBuf]) -> Result<(), &'static str> {
    if OOM_THROWER.get().is_some() {
        return Ok(());
    }
    use std::os::unix::ffi::OsStrExt;
    let handles: Vec<*mut c_void> = libs
        .iter()
        .filter_map(|p| std::ffi::CString::new(p.as_os_str().as_bytes()).ok())
        .map(|c| {
            // SAFETY: RTLD_NOLOAD only looks up a library already loaded (no
            // constructors run); the handle is kept for the process (the
            // library stays loaded under PyTorch).
            unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) }
        })
        .filter(|h| !h.is_null())
        .collect();
    let in_libs = |name: &CStr| handles.iter().find_map(|&h| symbol(h, name));
    let found = (|| -> Result<Thrower, &'static str> {
        if handles.is_empty() {
            return Err("none of the libraries is loaded");
        }
        let ctor = ERROR_CTORS
            .iter()
            .find_map(|n| in_libs(n))
            .ok_or("c10::Error's constructor")?;
        let (typeinfo, vtable, slot0) = handles
            .iter()
            .find_map(|&h| {
                // SAFETY: the symbol is a vtable (its mangled name says so), at
                // least offset-to-top, typeinfo and the two destructors long:
                // its first three words are read, nothing is written.
                unsafe { oom_vtable(symbol(h, OOM_VTABLE)?) }
            })
            .ok_or("c10::OutOfMemoryError's vtable (or its layout)")?;
        // The destructor by name where a library exports it (PyTorch 2.11
        // does not: it is inline); else the vtable's, which a virtual
        // destruction through a `c10::Error*` calls too.
        let dtor = ERROR_DTORS.iter().find_map(|n| in_libs(n)).unwrap_or(slot0);
        // The C++ runtime PyTorch's libraries use: through their handles
        // first (`dlsym` on a handle searches the library's dependencies,
        // and Python loads PyTorch with RTLD_LOCAL, so its libstdc++ is in
        // no global scope), then the process's global scope.
        let runtime = |name: &'static CStr| {
            in_libs(name)
                .or_else(|| symbol(std::ptr::null_mut(), name))
                .ok_or("the C++ runtime's exception or allocation calls")
        };
        let alloc_exception = runtime(c"__cxa_allocate_exception")?;
        let throw = runtime(c"__cxa_throw")?;
        let new = runtime(c"_Znwm")?;
        let delete = runtime(c"_ZdlPv")?;
        // SAFETY: each symbol is the function its mangled (or C) name says,
        // with the signature of the type it is given: `c10::Error`'s
        // constructor, `c10::OutOfMemoryError`'s complete-object destructor
        // (by name, or its vtable's first slot), the C++ ABI's two
        // exception calls, and `operator new(size_t)` / `operator
        // delete(void*)`.
        unsafe {
            Ok(Thrower {
                ctor: std::mem::transmute::<*mut c_void, ErrorCtor>(ctor),
                dtor: std::mem::transmute::<*mut c_void, Dtor>(dtor),
                typeinfo,
                vtable,
                alloc_exception: std::mem::transmute::<*mut c_void, AllocException>(
                    alloc_exception,
                ),
                throw: std::mem::transmute::<*mut c_void, Throw>(throw),
                new: std::mem::transmute::<*mut c_void, New>(new),
                delete: std::mem::transmute::<*mut c_void, Delete>(delete),
            })
        }
    })();
    match found {
        Ok(t) => {
            let _ = OOM_THROWER.set(t);
            Ok(())
        }
        Err(what) => Err(what),
    }
}

/// `c10::OutOfMemoryError`'s typeinfo, vtable address point and first
/// virtual slot (its complete-object destructor), from its vtable at
/// `start` (Itanium C++ ABI: offset to top, typeinfo, then the virtual
/// functions, `std::exception`'s destructors first), if the vtable is laid
/// out so: offset 0, a typeinfo named `N3c1016OutOfMemoryErrorE`, a slot.
///
/// # Safety
/// `start` is the start of a class's primary vtable of at least three
/// words.
unsafe fn oom_vtable(start: *mut c_void) -> Option<(*const c_void, *const c_void, *mut c_void)> {
    let words = start.cast::<*mut c_void>();
    // SAFETY: the caller's: three words of a vtable in a loaded library.
    let (top, typeinfo, slot0) = unsafe { (*words, *words.add(1), *words.add(2)) };
    if !top.is_null() || typeinfo.is_null() || slot0.is_null() {
        return None;
    }
    // A typeinfo object: its vtable pointer, then its name (a C string).
    // SAFETY: `typeinfo` is the vtable's typeinfo pointer, to a
    // `std::type_info` of two words at least.
    let name = unsafe { *typeinfo.cast::<*const c_char>().add(1) };
    if name.is_null() {
        return None;
    }
    // SAFETY: a type's name, NUL-terminated.
    let name = unsafe { CStr::from_ptr(name) };
    // SAFETY: the address point is two words in, inside the vtable.
    let point = unsafe { words.add(2) };
    (name == OOM_NAME).then_some((typeinfo.cast_const(), point.cast_const().cast(), slot0))
}

/// Whether [`throw_oom`] can throw.
pub(super) fn oom_available() -> bool {
    OOM_THROWER.get().is_some()
}

/// Throw `c10::OutOfMemoryError` with `message` (NUL-terminated, with no
/// interior NUL) into the C++ caller of the hook. Returns only if
/// [`find`] found nothing.
///
/// The frames it unwinds through must hold nothing to drop, and none may
/// be a `catch_unwind` (a foreign exception there aborts).
pub(super) fn throw_oom(message: &CStr) {
    let Some(t) = OOM_THROWER.get() else {
        return;
    };
    let text = message.to_bytes();
    // SAFETY: every function is the one `find` resolved (see there), called
    // with the arguments its C++ declaration takes:
    // - the string is built as libstdc++ builds a heap string: `operator
    //   new` of len + 1 bytes, NUL-terminated, capacity len. The
    //   constructor moves it out (leaving the argument pointing at its own
    //   empty buffer) or copies it; either way the argument is destroyed
    //   here afterwards, as the C++ caller of a by-value argument does.
    // - the exception object is the C++ runtime's, of OBJECT_BYTES (more
    //   than `c10::Error` needs); the constructor builds a `c10::Error` in
    //   it, whose vtable pointer (the object's first word) is then set to
    //   `c10::OutOfMemoryError`'s: the subclass adds no member and
    //   overrides nothing, so the object is one.
    // - `__cxa_throw` takes ownership and never returns; the runtime calls
    //   the destructor when the last catch is done with it.
    // The location's strings are static.
    unsafe {
        let buf = (t.new)(text.len() + 1).cast::<c_char>();
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, text.len());
        *buf.add(text.len()) = 0;
        let mut msg = CxxString {
            data: buf,
            len: text.len(),
            capacity_or_local: [text.len(), 0],
        };
        let object = (t.alloc_exception)(OBJECT_BYTES);
        std::ptr::write_bytes(object.cast::<u8>(), 0, OBJECT_BYTES);
        let location = SourceLocation {
            function: c"gpuptr_torch_alloc".as_ptr(),
            file: c"gpuptr".as_ptr(),
            line: 0,
        };
        (t.ctor)(object, location, &mut msg);
        let local = std::ptr::addr_of_mut!(msg.capacity_or_local).cast::<c_char>();
        if msg.data != local {
            // Copied, not moved: the argument still owns its heap buffer.
            (t.delete)(msg.data.cast());
        }
        *object.cast::<*const c_void>() = t.vtable;
        (t.throw)(object, t.typeinfo, Some(t.dtor))
    }
}

/// Find what throwing PyTorch's ``c10::OutOfMemoryError`` takes in the
/// loaded libraries at ``paths`` (``libc10.so`` and the others PyTorch
/// loaded; none is loaded by this call) and the C++ runtime, so that an
/// allocation that runs out of memory raises ``torch.cuda.OutOfMemoryError``.
/// None where everything was found; else what was not, in words (for the
/// warning ``install()`` logs), and out of memory raises through
/// ``_hooks_torch_errors``'s thrower, as a ``RuntimeError``.
#[pyo3::pyfunction]
pub(crate) fn _hooks_torch_oom_missing(paths: Vec<std::path::PathBuf>) -> Option<&'static str> {
    find(&paths).err()
}

/// PyTorch's own exception thrower (`c10::detail::torchCheckFail`, the
/// overload that takes C strings), found in its loaded `libc10` by
/// [`_hooks_torch_errors`]: a failed allocation raises through it, so
/// PyTorch gets a C++ exception (a catchable `RuntimeError` in Python)
/// where a null pointer would make it write through address 0.
type CheckFail = unsafe extern "C-unwind" fn(*const c_char, *const c_char, u32, *const c_char) -> !;
static CHECK_FAIL: OnceLock<CheckFail> = OnceLock::new();

/// The mangled name of `c10::detail::torchCheckFail(const char*, const
/// char*, uint32_t, const char*)`, in every PyTorch 2 (Itanium C++ ABI).
const TORCH_CHECK_FAIL: &CStr = c"_ZN3c106detail14torchCheckFailEPKcS2_jS2_";

/// PyTorch's `torchCheckFail`, if `_hooks_torch_errors` found it.
pub(super) fn check_fail() -> Option<CheckFail> {
    CHECK_FAIL.get().copied()
}

/// Find PyTorch's exception thrower in its loaded ``libc10`` at ``path``
/// (never loads the library: it must be loaded already), so a failed
/// allocation raises in PyTorch instead of returning a null pointer.
/// Whether it was found.
#[pyfunction]
pub(crate) fn _hooks_torch_errors(path: std::path::PathBuf) -> bool {
    if CHECK_FAIL.get().is_some() {
        return true;
    }
    use std::os::unix::ffi::OsStrExt;
    let Ok(cpath) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: RTLD_NOLOAD only looks up an already loaded library (no
    // constructors run); the handle is kept for the process, as the
    // library stays loaded under PyTorch.
    let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: a valid handle and a NUL-terminated name.
    let sym = unsafe { libc::dlsym(handle, TORCH_CHECK_FAIL.as_ptr()) };
    if sym.is_null() {
        return false;
    }
    // SAFETY: the symbol is `c10::detail::torchCheckFail(const char*, const
    // char*, uint32_t, const char*)`, which takes these four arguments and
    // always throws (`[[noreturn]]`).
    let f: CheckFail = unsafe { std::mem::transmute::<*mut c_void, CheckFail>(sym) };
    let _ = CHECK_FAIL.set(f);
    true
}
