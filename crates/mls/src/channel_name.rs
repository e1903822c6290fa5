//! Channel names: `org/namespace/service`. The same rule as `static/_channel_name.py`: three
//! components of `[A-Za-z0-9][A-Za-z0-9_.-]{0,62}` separated by `/`, at most 191 characters.
//! The MLS group id of a channel is the UTF-8 bytes of its name, exactly.

use crate::error::Error;

pub const MAX_CHANNEL_NAME_LENGTH: usize = 191;

/// The expected form, as every invalid-name error states it.
pub const CHANNEL_NAME_FORM: &str =
    "expected the form 'org/namespace/service': three non-empty components \
separated by '/', each 1-63 characters of letters, digits, '_', '.', '-', starting with a letter \
or digit";

fn valid_component(c: &str) -> bool {
    let bytes = c.as_bytes();
    match bytes.split_first() {
        Some((first, rest)) => {
            first.is_ascii_alphanumeric()
                && rest.len() <= 62
                && rest
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        }
        None => false,
    }
}

/// Whether `name` is a valid channel name.
pub fn is_valid_channel_name(name: &str) -> bool {
    if name.len() > MAX_CHANNEL_NAME_LENGTH {
        return false;
    }
    let parts: Vec<&str> = name.split('/').collect();
    parts.len() == 3 && parts.iter().all(|p| valid_component(p))
}

/// Returns `Ok(())` for a valid name, else an [`Error::InvalidChannelName`] naming the value
/// and the expected form.
pub fn validate_channel_name(name: &str) -> Result<(), Error> {
    if is_valid_channel_name(name) {
        return Ok(());
    }
    let shown: String = if name.chars().count() <= 80 {
        name.to_owned()
    } else {
        name.chars().take(77).chain("...".chars()).collect()
    };
    // Quoted as Python's repr quotes a plain name: the same text from every side.
    Err(Error::InvalidChannelName(format!(
        "'{}'; {CHANNEL_NAME_FORM}",
        shown.escape_debug()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_rejects() {
        for ok in [
            "acme/agents/planner",
            "a/b/c",
            "A1/b_2/c.d-e",
            &format!("{0}/{0}/{0}", "x".repeat(63)),
        ] {
            assert!(is_valid_channel_name(ok), "{ok}");
        }
        for bad in [
            "",
            "a/b",
            "a/b/c/d",
            "/a/b",
            "a//b",
            "a/b/",
            "_a/b/c",
            "a/b/-c",
            "a b/c/d",
            "a/b/c\n",
            "é/b/c",
            &format!("{}/b/c", "x".repeat(64)),
        ] {
            assert!(!is_valid_channel_name(bad), "{bad:?}");
        }
        // 3 * 63 + 2 = 191: the longest valid name; nothing longer passes.
        assert!(!is_valid_channel_name(&format!(
            "{0}/{0}/{0}x",
            "x".repeat(63)
        )));
    }

    #[test]
    fn message_names_value_and_form() {
        let err = validate_channel_name("nope")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.starts_with("invalid channel name: 'nope'"), "{err}");
        assert!(err.contains("org/namespace/service"), "{err}");
    }
}
