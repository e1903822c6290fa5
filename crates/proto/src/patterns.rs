//! Channel patterns (issue 30): the channels an API key, and every token minted from it, may
//! name. The relay enforces them; the server (Python, `static.auth`) mints them into the
//! token's `channels` claim; both read them with these rules.
//!
//! A pattern is `org/namespace/service`, each component `*` (any one component) or a literal
//! matched byte for byte (case-sensitive, no normalisation). A key has at most
//! [`MAX_PATTERNS`] of them; a key without any list reaches every channel (that is the
//! caller's `None`, not an empty list: an empty list reaches none).

use std::fmt;

/// Patterns one key carries at most.
pub const MAX_PATTERNS: usize = 100;
/// Bytes of one pattern at most (three channel-name components of 63, with room to spare).
pub const MAX_PATTERN_BYTES: usize = 255;
/// The words every refusal of a channel outside the caller's patterns holds (PERMISSION_DENIED):
/// how a client tells it from the relay's other permission refusals (membership, org owner).
pub const OUTSIDE_CHANNELS: &str = "is outside this key's channels";

/// One component of a pattern.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Component {
    Any,
    Literal(Box<str>),
}

impl Component {
    fn matches(&self, part: &str) -> bool {
        match self {
            Component::Any => true,
            Component::Literal(literal) => **literal == *part,
        }
    }
}

/// Why a pattern was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("channel pattern '{0}' must have 3 components 'org/namespace/service'")]
    Components(String),
    #[error("channel pattern '{0}': each component must be '*' or a non-empty name without '*'")]
    Component(String),
    #[error("channel pattern of {0} bytes: at most {MAX_PATTERN_BYTES}")]
    TooLong(usize),
    #[error("{0} channel patterns: at most {MAX_PATTERNS}")]
    TooMany(usize),
}

/// One pattern `org/namespace/service`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChannelPattern {
    parts: [Component; 3],
}

impl ChannelPattern {
    /// Parses a pattern: 3 components, each `*` or a non-empty literal without `*`.
    pub fn parse(text: &str) -> Result<ChannelPattern, PatternError> {
        if text.len() > MAX_PATTERN_BYTES {
            return Err(PatternError::TooLong(text.len()));
        }
        let shown = || text.escape_debug().to_string();
        let mut split = text.split('/');
        let mut next = || -> Result<Component, PatternError> {
            let part = split
                .next()
                .ok_or_else(|| PatternError::Components(shown()))?;
            match part {
                "*" => Ok(Component::Any),
                "" => Err(PatternError::Component(shown())),
                literal if literal.contains('*') => Err(PatternError::Component(shown())),
                literal => Ok(Component::Literal(literal.into())),
            }
        };
        let parts = [next()?, next()?, next()?];
        if split.next().is_some() {
            return Err(PatternError::Components(shown()));
        }
        Ok(ChannelPattern { parts })
    }

    /// Whether `channel` (`org/namespace/service`) matches; a name of another shape never does.
    pub fn matches(&self, channel: &str) -> bool {
        let mut split = channel.split('/');
        self.parts
            .iter()
            .all(|component| split.next().is_some_and(|part| component.matches(part)))
            && split.next().is_none()
    }
}

impl fmt::Display for ChannelPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, component) in self.parts.iter().enumerate() {
            if index > 0 {
                f.write_str("/")?;
            }
            match component {
                Component::Any => f.write_str("*")?,
                Component::Literal(literal) => f.write_str(literal)?,
            }
        }
        Ok(())
    }
}

/// The patterns of one key: a channel is reachable when any of them matches it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChannelPatterns(Vec<ChannelPattern>);

impl ChannelPatterns {
    /// Parses a key's list (at most [`MAX_PATTERNS`]); the first bad pattern refuses it all.
    pub fn parse<S: AsRef<str>>(patterns: &[S]) -> Result<ChannelPatterns, PatternError> {
        if patterns.len() > MAX_PATTERNS {
            return Err(PatternError::TooMany(patterns.len()));
        }
        patterns
            .iter()
            .map(|p| ChannelPattern::parse(p.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map(ChannelPatterns)
    }

    /// Whether any pattern matches `channel` (at most 100 comparisons of 3 components).
    pub fn matches(&self, channel: &str) -> bool {
        self.0.iter().any(|p| p.matches(channel))
    }

    pub fn patterns(&self) -> &[ChannelPattern] {
        &self.0
    }

    /// The refusal's text for `channel` outside these patterns (holds [`OUTSIDE_CHANNELS`]).
    pub fn refusal(&self, channel: &str) -> String {
        format!("channel {channel} {OUTSIDE_CHANNELS} ({self})")
    }
}

impl fmt::Display for ChannelPatterns {
    /// The patterns, `, `-separated (`none` for an empty list).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (index, pattern) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{pattern}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn patterns(list: &[&str]) -> ChannelPatterns {
        ChannelPatterns::parse(list).unwrap()
    }

    #[test]
    fn literals_and_wildcards_match_one_component_each() {
        let p = patterns(&["acme/ops/*", "acme/*/billing", "other/x/y"]);
        for yes in [
            "acme/ops/a",
            "acme/ops/billing",
            "acme/sales/billing",
            "other/x/y",
        ] {
            assert!(p.matches(yes), "{yes}");
        }
        for no in [
            "acme/sales/a",
            "Acme/ops/a",
            "acme/ops",
            "acme/ops/a/b",
            "other/x/Y",
            "acmee/ops/a",
            "",
        ] {
            assert!(!p.matches(no), "{no}");
        }
        assert!(patterns(&["*/*/*"]).matches("a/b/c"));
        assert!(!patterns(&[]).matches("a/b/c"));
    }

    #[test]
    fn malformed_patterns_are_refused() {
        for bad in [
            "", "a", "a/b", "a/b/c/d", "a//c", "/b/c", "a/b/", "a/b*/c", "**/b/c", "a/b/c*",
        ] {
            assert!(ChannelPattern::parse(bad).is_err(), "{bad}");
        }
        let long = format!("a/b/{}", "c".repeat(MAX_PATTERN_BYTES));
        assert_eq!(
            ChannelPattern::parse(&long),
            Err(PatternError::TooLong(long.len()))
        );
        let many = vec!["a/b/c"; MAX_PATTERNS + 1];
        assert_eq!(
            ChannelPatterns::parse(&many),
            Err(PatternError::TooMany(MAX_PATTERNS + 1))
        );
        assert!(ChannelPatterns::parse(&vec!["a/b/c"; MAX_PATTERNS]).is_ok());
    }

    #[test]
    fn refusals_name_the_channel_and_the_patterns() {
        let p = patterns(&["acme/ops/*", "acme/x/y"]);
        assert_eq!(
            p.refusal("acme/x/z"),
            "channel acme/x/z is outside this key's channels (acme/ops/*, acme/x/y)"
        );
        assert_eq!(
            patterns(&[]).refusal("a/b/c"),
            "channel a/b/c is outside this key's channels (none)"
        );
    }

    fn component() -> impl Strategy<Value = String> {
        prop_oneof![Just("*".to_owned()), "[a-c]{1,2}"]
    }

    proptest! {
        /// A pattern prints as it was parsed, and matches a name exactly when each of its
        /// components is `*` or equal to the name's.
        #[test]
        fn matching_is_per_component(
            pattern in proptest::array::uniform3(component()),
            name in proptest::array::uniform3("[a-c]{1,2}"),
        ) {
            let text = pattern.join("/");
            let parsed = ChannelPattern::parse(&text).unwrap();
            prop_assert_eq!(parsed.to_string(), text);
            let expected = pattern.iter().zip(&name).all(|(p, n)| p == "*" || p == n);
            prop_assert_eq!(parsed.matches(&name.join("/")), expected);
        }
    }
}
