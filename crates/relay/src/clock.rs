//! Wall-clock time as the relay stamps entries and Welcomes with it: unix milliseconds.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in unix milliseconds (the time entries and Welcomes are stamped with).
pub(crate) fn now_ms() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}
