//! Strided array layouts (CUDA Array Interface, DLPack): validate shape,
//! strides and element type, and find the bytes an array spans.

use crate::error::{Error, Result};

/// A validated strided layout. Strides are in bytes and may be negative.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Elements along each dimension.
    pub shape: Vec<usize>,
    /// Byte step along each dimension.
    pub strides: Vec<i64>,
    /// Bytes per element.
    pub itemsize: usize,
    /// Lowest byte offset any element has from element 0 (`<= 0`).
    pub lo: i64,
    /// Bytes from the lowest to the end of the highest element (0 if empty).
    pub span: usize,
}

/// The element size of an array-interface typestr such as `"<f4"` or
/// `"|u1"`; kinds `b i u f c V` are accepted.
pub fn typestr_itemsize(typestr: &str) -> Result<usize> {
    let bad = || {
        Error::InvalidArgument(format!(
            "typestr {typestr:?} is not a device array element type"
        ))
    };
    let b = typestr.as_bytes();
    if b.len() < 3 || !matches!(b[0], b'<' | b'>' | b'|' | b'=') {
        return Err(bad());
    }
    if !matches!(b[1], b'b' | b'i' | b'u' | b'f' | b'c' | b'V') {
        return Err(bad());
    }
    let digits = &typestr[2..];
    if !digits.bytes().all(|c| c.is_ascii_digit()) || digits.starts_with('0') {
        return Err(bad());
    }
    // Item sizes fit an i64 (strides are signed byte counts), and each kind
    // has the sizes numpy gives it (`<f3` is no type a consumer can read);
    // raw bytes (`V`) any size.
    let known = |n: usize| match b[1] {
        b'b' => n == 1,
        b'i' | b'u' => matches!(n, 1 | 2 | 4 | 8),
        b'f' => matches!(n, 2 | 4 | 8 | 16),
        b'c' => matches!(n, 8 | 16 | 32),
        _ => true,
    };
    match digits.parse::<usize>() {
        Ok(n) if n > 0 && i64::try_from(n).is_ok() && known(n) => Ok(n),
        _ => Err(bad()),
    }
}

impl Layout {
    /// Validate `shape` and `strides` (C-contiguous when `None`) for
    /// elements of `itemsize` bytes.
    pub fn new(shape: Vec<usize>, strides: Option<Vec<i64>>, itemsize: usize) -> Result<Layout> {
        let overflow = || Error::InvalidArgument("the array's extent overflows".into());
        let itemsize_i64 = i64::try_from(itemsize).map_err(|_| overflow())?;
        // Every dimension fits an i64 (as DLPack's do), and the element
        // count a usize: `as i64` below would wrap one past 2**63.
        if shape.iter().any(|&n| i64::try_from(n).is_err())
            || shape
                .iter()
                .try_fold(1usize, |a, &n| a.checked_mul(n))
                .is_none()
        {
            return Err(overflow());
        }
        let strides = match strides {
            Some(s) if s.len() != shape.len() => {
                return Err(Error::InvalidArgument(format!(
                    "strides {s:?} do not match shape {shape:?}"
                )))
            }
            Some(s) => s,
            None => {
                let mut s = vec![0i64; shape.len()];
                let mut step = itemsize_i64;
                for (i, n) in shape.iter().enumerate().rev() {
                    s[i] = step;
                    step = step.checked_mul((*n).max(1) as i64).ok_or_else(overflow)?;
                }
                s
            }
        };
        let (mut lo, mut hi) = (0i64, 0i64);
        let empty = shape.contains(&0);
        if !empty {
            for (n, st) in shape.iter().zip(&strides) {
                let reach = (*n as i64 - 1).checked_mul(*st).ok_or_else(overflow)?;
                if reach >= 0 {
                    hi = hi.checked_add(reach).ok_or_else(overflow)?;
                } else {
                    lo = lo.checked_add(reach).ok_or_else(overflow)?;
                }
            }
        }
        let span = if empty {
            0
        } else {
            usize::try_from(
                hi.checked_sub(lo)
                    .and_then(|d| d.checked_add(itemsize_i64))
                    .ok_or_else(overflow)?,
            )
            .map_err(|_| overflow())?
        };
        Ok(Layout {
            shape,
            strides,
            itemsize,
            lo,
            span,
        })
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dimension_past_i64_or_an_element_count_past_usize_overflows() {
        for shape in [vec![usize::MAX], vec![1 << 63], vec![1 << 40, 1 << 40]] {
            let e = Layout::new(shape.clone(), None, 1).unwrap_err();
            assert!(e.to_string().contains("overflows"), "{shape:?}: {e}");
            let e = Layout::new(shape.clone(), Some(vec![1; shape.len()]), 1).unwrap_err();
            assert!(
                e.to_string().contains("overflows"),
                "{shape:?} strided: {e}"
            );
        }
        // With a zero dimension the count is 0 and nothing is reached.
        assert_eq!(Layout::new(vec![0, 1 << 40], None, 1).unwrap().span, 0);
    }

    #[test]
    fn typestrs() {
        assert_eq!(typestr_itemsize("<f4").unwrap(), 4);
        assert_eq!(typestr_itemsize("|u1").unwrap(), 1);
        assert_eq!(typestr_itemsize("|V16").unwrap(), 16);
        assert!(typestr_itemsize("|V18446744073709551615").is_err());
        assert!(typestr_itemsize("|V9223372036854775808").is_err());
        for bad in ["f4", "<x4", "<f0", "<f", "float32", "<f4x", ""] {
            assert!(typestr_itemsize(bad).is_err(), "{bad}");
        }
        // Sizes no consumer has a type for (they imported, then numpy and
        // numba raised an untyped error), and leading zeros.
        for bad in ["<f3", "<c3", "|b4", "<i16", "<f04", "|V04"] {
            assert!(typestr_itemsize(bad).is_err(), "{bad}");
        }
        for good in ["<f2", "<f16", "<c32", "|b1", "<u8", "|V3"] {
            assert!(typestr_itemsize(good).is_ok(), "{good}");
        }
    }

    #[test]
    fn layouts() {
        let c = Layout::new(vec![4, 8], None, 4).unwrap();
        assert_eq!(c.strides, vec![32, 4]);
        assert_eq!((c.lo, c.span), (0, 128));
        let neg = Layout::new(vec![10], Some(vec![-4]), 4).unwrap();
        assert_eq!((neg.lo, neg.span), (-36, 40));
        let empty = Layout::new(vec![0, 5], None, 8).unwrap();
        assert_eq!(empty.span, 0);
        assert!(Layout::new(vec![2], Some(vec![4, 4]), 4).is_err());
        assert!(Layout::new(vec![usize::MAX / 2, 4], None, 8).is_err());
        let sparse = Layout::new(vec![3], Some(vec![100]), 1).unwrap();
        assert_eq!(sparse.span, 201);
    }
}
