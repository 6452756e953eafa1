//! One parser for sizes, in settings and arguments alike: `GPUPTR_*`
//! variables, `set_pool_limit`, `reserve` and the Dask plugin.
//!
//! A size is a count of bytes (`1073741824`), a number with a unit
//! (`"40GB"`, `"40GiB"`, `"512M"`, `"1.5 GiB"`), or a share of the
//! device's memory: a float in (0, 1] (`0.8`) or a percentage (`"80%"`).
//! Units follow Dask's `parse_bytes`, which dask-cuda's `rmm_pool_size`
//! uses: `k`/`kB`, `M`/`MB`, `G`/`GB`, `T`/`TB` are powers of 1000, `KiB`,
//! `MiB`, `GiB`, `TiB` powers of 1024, case aside.

use crate::error::{Error, Result};

/// A size as written: bytes, or a share of the device's memory.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Size {
    /// A count of bytes.
    Bytes(usize),
    /// A share of the device's total memory, in (0, 1].
    Share(f64),
}

impl Size {
    /// The bytes this size means on a device of `total` bytes.
    pub fn bytes_of(self, total: usize) -> usize {
        match self {
            Size::Bytes(n) => n,
            Size::Share(f) => (total as f64 * f).floor() as usize,
        }
    }

    /// [`Size::bytes_of`], refusing a share that comes to no byte at all
    /// (`1e-12` of the device): `InvalidArgument` naming `setting`, where
    /// flooring would silently set 0 bytes.
    pub fn bytes_on(self, total: usize, setting: &str) -> Result<usize> {
        let n = self.bytes_of(total);
        match self {
            Size::Share(f) if n == 0 => Err(Error::InvalidArgument(format!(
                "{setting}={f} is less than one byte of the device's {total} bytes (give a share of at least 1/{total}, or bytes)"
            ))),
            _ => Ok(n),
        }
    }

    /// A share `f` of the device, checked to be in (0, 1]; `setting`
    /// names what was set, for the error.
    pub fn share(f: f64, setting: &str) -> Result<Size> {
        if f > 0.0 && f <= 1.0 {
            Ok(Size::Share(f))
        } else {
            Err(Error::InvalidArgument(format!(
                "{setting}={f} is not a share of the device in (0, 1] (for bytes, give an int or a size such as \"40GB\")"
            )))
        }
    }
}

/// The most bytes a size may be, written in any form: 2**63-1, the range
/// of an int size argument too (one rule for strings and ints).
pub const MAX_BYTES: usize = i64::MAX as usize;

/// Bytes per unit, by lower-case name.
fn unit(name: &str) -> Option<f64> {
    Some(match name {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "p" | "pb" => 1e15,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "pib" => 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    })
}

/// Parse `text`, the value of `setting` (named in the error).
pub fn parse(text: &str, setting: &str) -> Result<Size> {
    parse_as(text, setting, true)
}

/// Parse `text`, the value of `setting`, as bytes only: for the sizes that
/// are not of a device (`GPUPTR_SIM_MEMORY`, `GPUPTR_POOL_AHEAD`,
/// `GPUPTR_HOST_CACHE`, `reserve`'s `block_size`). A share is refused, and
/// no error's hint offers one.
pub fn parse_bytes(text: &str, setting: &str) -> Result<usize> {
    match parse_as(text, setting, false)? {
        Size::Bytes(n) => Ok(n),
        Size::Share(_) => Err(not_a_share(text, setting)),
    }
}

/// The refusal of a share where only bytes are taken.
pub(crate) fn not_a_share(text: &str, setting: &str) -> Error {
    Error::InvalidArgument(format!(
        "{setting}={text:?}: a share of a device (0.8, \"80%\") is not taken here; {BYTES_HINT}"
    ))
}

/// What a size in bytes may be written as (each form here is taken).
const BYTES_HINT: &str =
    "give bytes (1073741824) or a size such as \"1GiB\", \"512MiB\" or \"500M\"";

/// [`parse`], or [`parse_bytes`] when `shares` is false (then a share is
/// refused here, and the hint names bytes only).
fn parse_as(text: &str, setting: &str, shares: bool) -> Result<Size> {
    let bad = |why: &str| {
        let hint = if shares {
            "give bytes, a size such as \"40GB\", \"40GiB\" or \"512M\", a share such as 0.8, or \"80%\""
        } else {
            BYTES_HINT
        };
        Error::InvalidArgument(format!("{setting}={text:?} is not a size ({why}; {hint})"))
    };
    let t = text.trim();
    if let Some(p) = t.strip_suffix('%') {
        if !shares {
            return Err(not_a_share(text, setting));
        }
        let v: f64 = p.trim().parse().map_err(|_| bad("not a number before %"))?;
        return Size::share(v / 100.0, setting)
            .map_err(|_| bad("a percentage must be in (0, 100]"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (number, name) = (
        t[..split].replace('_', ""),
        t[split..].trim().to_ascii_lowercase(),
    );
    if number.is_empty() {
        return Err(bad("no number"));
    }
    let per = unit(&name).ok_or_else(|| bad("unknown unit"))?;
    if name.is_empty() {
        if number.contains('.') {
            if !shares {
                return Err(not_a_share(text, setting));
            }
            let f: f64 = number.parse().map_err(|_| bad("not a number"))?;
            return Size::share(f, setting).map_err(|_| bad("a share must be in (0, 1]"));
        }
        return number
            .parse::<usize>()
            .ok()
            .filter(|n| *n <= MAX_BYTES)
            .map(Size::Bytes)
            .ok_or_else(|| bad("more than 2**63-1 bytes, or not a whole number"));
    }
    let v: f64 = number.parse().map_err(|_| bad("not a number"))?;
    let bytes = v * per;
    // 2**63 is exact as an f64: anything from it up is past the range.
    if !bytes.is_finite() || bytes.round() >= 9_223_372_036_854_775_808.0 {
        return Err(bad("more than 2**63-1 bytes"));
    }
    Ok(Size::Bytes(bytes.round() as usize))
}

/// A switch as written in a setting: `1`/`on`/`true`/`yes` or
/// `0`/`off`/`false`/`no`, case aside; `None` when empty.
pub fn switch(text: &str, setting: &str) -> Result<Option<bool>> {
    match text.trim().to_ascii_lowercase().as_str() {
        "" => Ok(None),
        "1" | "on" | "true" | "yes" => Ok(Some(true)),
        "0" | "off" | "false" | "no" => Ok(Some(false)),
        _ => Err(Error::InvalidArgument(format!(
            "{setting}={text:?} is not a switch (use 1/on/true/yes or 0/off/false/no)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_as_users_write_them() {
        let p = |t: &str| parse(t, "X").unwrap();
        assert_eq!(p("1073741824"), Size::Bytes(1 << 30));
        assert_eq!(p("40GB"), Size::Bytes(40_000_000_000));
        assert_eq!(p("40GiB"), Size::Bytes(40 << 30));
        assert_eq!(p("40 gib"), Size::Bytes(40 << 30));
        assert_eq!(p("512M"), Size::Bytes(512_000_000));
        assert_eq!(p("512MiB"), Size::Bytes(512 << 20));
        assert_eq!(p("1.5GiB"), Size::Bytes(3 << 29));
        assert_eq!(p("64k"), Size::Bytes(64_000));
        assert_eq!(p("1_000"), Size::Bytes(1000));
        assert_eq!(p("0"), Size::Bytes(0));
        assert_eq!(p("0.8"), Size::Share(0.8));
        assert_eq!(p("1.0"), Size::Share(1.0));
        assert_eq!(p("80%"), Size::Share(0.8));
        assert_eq!(p(" 100 % "), Size::Share(1.0));
        assert_eq!(p("80%").bytes_of(1000), 800);
        assert_eq!(p("40GB").bytes_of(1), 40_000_000_000);
        assert_eq!(p("9223372036854775807"), Size::Bytes(MAX_BYTES));
        assert!(Size::Share(1e-12).bytes_on(1 << 30, "nbytes").is_err());
        assert_eq!(Size::Share(0.5).bytes_on(1000, "nbytes").unwrap(), 500);
    }

    #[test]
    fn bad_sizes_name_the_setting() {
        for t in [
            "",
            "banana",
            "40XB",
            "1.5",
            "0.0",
            "-1",
            "0%",
            "101%",
            "%",
            "GB",
            "1e400GB",
            "99999999999999999999",
            "99999999999PB",
            "18446744073709551615",
            "9223372036854775808",
            "8EiB",
        ] {
            let e = parse(t, "GPUPTR_SIM_MEMORY").unwrap_err().to_string();
            assert!(e.contains("GPUPTR_SIM_MEMORY"), "{t:?}: {e}");
        }
    }

    #[test]
    fn byte_sizes_refuse_shares_and_offer_only_what_they_take() {
        let p = |t: &str| parse_bytes(t, "GPUPTR_SIM_MEMORY");
        assert_eq!(p("1GiB").unwrap(), 1 << 30);
        assert_eq!(p("1073741824").unwrap(), 1 << 30);
        for share in ["80%", "0.5", "1.0"] {
            let e = p(share).unwrap_err().to_string();
            assert!(
                e.contains("GPUPTR_SIM_MEMORY") && e.contains("share"),
                "{e}"
            );
        }
        let e = p("abc").unwrap_err().to_string();
        assert!(
            e.contains("GPUPTR_SIM_MEMORY") && !e.contains("share such as"),
            "{e}"
        );
        // Every form the hint offers is taken.
        for form in BYTES_HINT.split('"').skip(1).step_by(2) {
            assert!(p(form).is_ok(), "{form}");
        }
        assert!(p(BYTES_HINT.split(['(', ')']).nth(1).unwrap()).is_ok());
    }

    #[test]
    fn switches() {
        assert_eq!(switch("yes", "X").unwrap(), Some(true));
        assert_eq!(switch("ON", "X").unwrap(), Some(true));
        assert_eq!(switch("off", "X").unwrap(), Some(false));
        assert_eq!(switch("", "X").unwrap(), None);
        assert!(switch("banana", "GPUPTR_POOL")
            .unwrap_err()
            .to_string()
            .contains("GPUPTR_POOL"));
    }
}
