//! The wall clock and this host, for names a person reads (log folders, lock files).

/// Time since the Unix epoch (zero on a clock set before it).
pub(crate) fn since_epoch() -> std::time::Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// Whole seconds since the Unix epoch.
pub(crate) fn unix_seconds() -> i64 {
    since_epoch().as_secs() as i64
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
pub(crate) fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// English month names, January first.
pub(crate) const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// `secs` (UTC) as transformers names a run's log folder: `Dec06_02-44-35`.
pub(crate) fn run_stamp(secs: i64) -> String {
    let (_, m, d) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!(
        "{}{d:02}_{:02}-{:02}-{:02}",
        &MONTHS[(m - 1) as usize][..3],
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// This machine's host name (`localhost` when it cannot be read).
pub(crate) fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass; gethostname
    // writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match rc {
        0 if end > 0 => String::from_utf8_lossy(&buf[..end]).into_owned(),
        _ => "localhost".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_stamps_read_as_transformers_writes_them() {
        // 2026-12-06 02:44:35 UTC.
        assert_eq!(run_stamp(1_796_525_075), "Dec06_02-44-35");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_423), (2025, 12, 1));
        assert!(!host_name().is_empty());
    }
}
