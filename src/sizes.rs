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
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "{setting}={text:?} is not a size ({why}; give bytes, a size such as \"40GB\", \"40GiB\" or \"512M\", a share such as 0.8, or \"80%\")"
        ))
    };
    let t = text.trim();
    if let Some(p) = t.strip_suffix('%') {
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
