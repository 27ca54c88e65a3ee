//! Kubernetes resource quantities, parsed and printed exactly.
//!
//! A quantity is `<sign><number><suffix>`: the number is a decimal with an optional fraction, the suffix a
//! binary SI one (`Ki Mi Gi Ti Pi Ei`), a decimal SI one (`n u m k M G T P E`) or a decimal exponent
//! (`e3`, `E-2`). GPU memory is counted in bytes, so [`parse_bytes`] rounds a fractional byte count up, as
//! the Kubernetes API server does when it converts a quantity to an integer.

use std::fmt;

/// Why a string is not a quantity this project accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The text is empty.
    #[error("is empty; write a size such as 8Gi, 500Mi or 8589934592")]
    Empty,
    /// The text does not follow the Kubernetes quantity grammar.
    #[error("{0:?} is not a Kubernetes quantity; write a size such as 8Gi, 500Mi or 8589934592")]
    Malformed(String),
    /// The quantity is negative.
    #[error("{0:?} is negative; GPU memory must be a positive size")]
    Negative(String),
    /// The quantity is larger than any GPU memory could be (over 2^63 bytes).
    #[error("{0:?} is too large")]
    TooLarge(String),
    /// The quantity is not a whole number where one is required ([`parse_whole`]).
    #[error("{0:?} is not a whole number")]
    NotWhole(String),
}

/// Parses a Kubernetes quantity into whole bytes (fractions of a byte round up).
///
/// ```
/// use gpubudget_common::quantity::parse_bytes;
/// assert_eq!(parse_bytes("8Gi").unwrap(), 8 * 1024 * 1024 * 1024);
/// assert_eq!(parse_bytes("8G").unwrap(), 8_000_000_000);
/// assert_eq!(parse_bytes("1.5Gi").unwrap(), 1_610_612_736);
/// assert!(parse_bytes("8 GiB").is_err());
/// ```
pub fn parse_bytes(text: &str) -> Result<u64, QuantityError> {
    let (shifted, scale) = parse_scaled(text)?;
    let value = if scale >= 0 {
        scaled_up(shifted, scale, text)?
    } else {
        match 10u128.checked_pow(scale.unsigned_abs()) {
            Some(p) => shifted.div_ceil(p),
            // Dividing by more than 10^38 leaves at most one byte.
            None => u128::from(shifted != 0),
        }
    };
    at_most_i64(value, text)
}

/// Parses a Kubernetes quantity that must be a whole number (`20k`, `1e4`, `20000`, `3Ki`, `1500m` is not):
/// how the API server stores a count or a size an extended resource names (it writes `20000` as `20k`).
///
/// ```
/// use gpubudget_common::quantity::parse_whole;
/// assert_eq!(parse_whole("20k").unwrap(), 20_000);
/// assert_eq!(parse_whole("1e4").unwrap(), 10_000);
/// assert_eq!(parse_whole("2Ki").unwrap(), 2048);
/// assert!(parse_whole("1500m").is_err());
/// ```
pub fn parse_whole(text: &str) -> Result<u64, QuantityError> {
    let (shifted, scale) = parse_scaled(text)?;
    let value = if scale >= 0 {
        scaled_up(shifted, scale, text)?
    } else {
        match 10u128.checked_pow(scale.unsigned_abs()) {
            Some(p) if shifted.is_multiple_of(p) => shifted / p,
            None if shifted == 0 => 0,
            _ => return Err(QuantityError::NotWhole(text.to_owned())),
        }
    };
    at_most_i64(value, text)
}

fn scaled_up(shifted: u128, scale: i32, text: &str) -> Result<u128, QuantityError> {
    10u128
        .checked_pow(scale.unsigned_abs())
        .and_then(|p| shifted.checked_mul(p))
        .ok_or_else(|| QuantityError::TooLarge(text.to_owned()))
}

fn at_most_i64(value: u128, text: &str) -> Result<u64, QuantityError> {
    u64::try_from(value).ok().filter(|v| *v <= i64::MAX as u64).ok_or_else(|| QuantityError::TooLarge(text.to_owned()))
}

/// A quantity as `shifted × 10^scale`: its digits times its binary suffix, and the decimal exponent left.
fn parse_scaled(text: &str) -> Result<(u128, i32), QuantityError> {
    if text.is_empty() {
        return Err(QuantityError::Empty);
    }
    let malformed = || QuantityError::Malformed(text.to_owned());
    let (negative, rest) = match text.as_bytes()[0] {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let number_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(number_end);
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if (int_part.is_empty() && frac_part.is_empty()) || frac_part.contains('.') {
        return Err(malformed());
    }
    // mantissa = digits of int and fraction; value = mantissa * 10^(exp10 - frac_len) * 2^exp2
    let digits: String = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 30 {
        return Err(QuantityError::TooLarge(text.to_owned()));
    }
    let mantissa: u128 = if digits.is_empty() { 0 } else { digits.parse().map_err(|_| malformed())? };
    let (exp2, exp10): (u32, i32) = match suffix {
        "" => (0, 0),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "n" => (0, -9),
        "u" => (0, -6),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        s if s.starts_with(['e', 'E']) => {
            let exp = &s[1..];
            let unsigned = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) || unsigned.len() > 3 {
                return Err(malformed());
            }
            (0, exp.parse().map_err(|_| malformed())?)
        }
        _ => return Err(malformed()),
    };
    if negative && mantissa != 0 {
        return Err(QuantityError::Negative(text.to_owned()));
    }
    let scale = exp10 - i32::try_from(frac_part.len()).map_err(|_| malformed())?;
    let too_large = || QuantityError::TooLarge(text.to_owned());
    let shifted = mantissa.checked_shl(exp2).filter(|v| v >> exp2 == mantissa).ok_or_else(too_large)?;
    Ok((shifted, scale))
}

/// Prints bytes the way Kubernetes canonicalises a binary quantity: the largest binary suffix that
/// divides the value exactly (`8Gi`, `1536Mi`), or plain bytes.
///
/// ```
/// use gpubudget_common::quantity::format_exact;
/// assert_eq!(format_exact(8 << 30), "8Gi");
/// assert_eq!(format_exact(1_610_612_736), "1536Mi");
/// assert_eq!(format_exact(8_000_000_001), "8000000001");
/// ```
pub fn format_exact(bytes: u64) -> String {
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if bytes == 0 {
        return "0".to_owned();
    }
    let mut value = bytes;
    let mut index = 0;
    while index < SUFFIXES.len() - 1 && value.is_multiple_of(1024) {
        value /= 1024;
        index += 1;
    }
    format!("{value}{}", SUFFIXES[index])
}

/// Human-readable bytes for messages and tables: binary units with one decimal (`9.2Gi`, `510Mi`,
/// `8Gi`). Whole values print without the decimal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanBytes(pub u64);

impl fmt::Display for HumanBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
        let bytes = self.0;
        if bytes < 1024 {
            return write!(f, "{bytes}B");
        }
        let mut unit = 0;
        let mut scale: u64 = 1024;
        while unit + 1 < UNITS.len() && bytes >= scale * 1024 {
            scale *= 1024;
            unit += 1;
        }
        // tenths of the unit, rounded to nearest
        let tenths = (u128::from(bytes) * 10 + u128::from(scale) / 2) / u128::from(scale);
        let (whole, frac) = (tenths / 10, tenths % 10);
        if frac == 0 { write!(f, "{whole}{}", UNITS[unit]) } else { write!(f, "{whole}.{frac}{}", UNITS[unit]) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_the_forms_users_write() {
        let cases: &[(&str, u64)] = &[
            ("8Gi", 8_589_934_592),
            ("8589934592", 8_589_934_592),
            ("8G", 8_000_000_000),
            ("500Mi", 524_288_000),
            ("1.5Gi", 1_610_612_736),
            ("0.5Ki", 512),
            ("1k", 1000),
            ("1e3", 1000),
            ("1E+3", 1000),
            ("12e-1", 2),
            ("1500m", 2),
            ("1000m", 1),
            ("+1Ki", 1024),
            ("0", 0),
            (".5Ki", 512),
            ("5.", 5),
            ("1Ei", 1 << 60),
            ("1n", 1),
        ];
        for (text, want) in cases {
            assert_eq!(parse_bytes(text), Ok(*want), "{text}");
        }
    }

    #[test]
    fn rejects_malformed_text_with_a_reason() {
        for text in ["", "8 Gi", "8GiB", "8gi", "Gi", "8Gi ", "1.2.3", "0x10", "1e", "1e+", "--1", "8KI", "."] {
            let err = parse_bytes(text).expect_err(text);
            let expected = if text.is_empty() { QuantityError::Empty } else { QuantityError::Malformed(text.into()) };
            assert_eq!(err, expected, "{text}: {err}");
        }
        assert_eq!(parse_bytes("-1Gi"), Err(QuantityError::Negative("-1Gi".into())));
        assert!(matches!(parse_bytes("16Ei"), Err(QuantityError::TooLarge(_))));
        assert!(matches!(parse_bytes("99999999999999999999999999999999"), Err(QuantityError::TooLarge(_))));
    }

    /// The API server stores an extended resource's `20000` as `20k`: each form of a whole number reads the
    /// same, and a fraction is refused, never rounded.
    #[test]
    fn whole_numbers_read_in_every_stored_form() {
        for (text, want) in
            [("20000", 20_000), ("20k", 20_000), ("2e4", 20_000), ("1E+4", 10_000), ("3k", 3_000), ("20Ki", 20_480)]
        {
            assert_eq!(parse_whole(text), Ok(want), "{text}");
        }
        for (text, want) in [("0", 0), ("0.0", 0), ("1.5k", 1_500), ("1000m", 1), ("1e0", 1), ("0e-99", 0)] {
            assert_eq!(parse_whole(text), Ok(want), "{text}");
        }
        for text in ["1500m", "0.5", "1e-1", "1n", "20.5"] {
            assert_eq!(parse_whole(text), Err(QuantityError::NotWhole(text.into())), "{text}");
        }
        assert!(matches!(parse_whole("-1k"), Err(QuantityError::Negative(_))));
        assert!(matches!(parse_whole("20 k"), Err(QuantityError::Malformed(_))));
    }

    #[test]
    fn formats_canonically_and_for_people() {
        assert_eq!(format_exact(0), "0");
        assert_eq!(format_exact(1023), "1023");
        assert_eq!(format_exact(500 << 20), "500Mi");
        assert_eq!(HumanBytes(9_878_424_780).to_string(), "9.2Gi");
        assert_eq!(HumanBytes(8 << 30).to_string(), "8Gi");
        assert_eq!(HumanBytes(534_773_760).to_string(), "510Mi");
        assert_eq!(HumanBytes(2_787_115_008).to_string(), "2.6Gi");
        assert_eq!(HumanBytes(17).to_string(), "17B");
    }

    proptest! {
        #[test]
        fn exact_format_round_trips(bytes in 0u64..=(i64::MAX as u64)) {
            prop_assert_eq!(parse_bytes(&format_exact(bytes)), Ok(bytes));
        }

        #[test]
        fn never_panics(text in "\\PC{0,24}") {
            let _ = parse_bytes(&text);
        }

        /// Every decimal form the API server may store a whole number in reads back as that number, and
        /// a whole reading is the byte reading (only fractions differ: refused here, rounded up there).
        #[test]
        fn whole_numbers_in_any_form(n in 0u64..1_000_000_000, text in "[0-9]{1,6}(\\.[0-9]{1,4})?([kMGm]|e-?[0-9])?") {
            for form in [n.to_string(), format!("{n}k"), format!("{n}e3"), format!("{n}000m"), format!("{n}.000")] {
                let want = if form.ends_with('k') || form.ends_with("e3") { n * 1000 } else { n };
                prop_assert_eq!(parse_whole(&form), Ok(want), "{}", form);
            }
            match parse_whole(&text) {
                Ok(v) => prop_assert_eq!(parse_bytes(&text), Ok(v)),
                Err(QuantityError::NotWhole(_)) => prop_assert!(parse_bytes(&text).is_ok()),
                Err(e) => prop_assert_eq!(parse_bytes(&text), Err(e)),
            }
        }

        #[test]
        fn binary_suffixes_scale(n in 0u64..1_000_000, suffix in 0usize..4) {
            let names = ["Ki", "Mi", "Gi", "Ti"];
            prop_assert_eq!(parse_bytes(&format!("{n}{}", names[suffix])), Ok(n << (10 * (suffix + 1))));
        }
    }
}
