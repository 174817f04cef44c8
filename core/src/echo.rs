//! Client or snapshot text repeated in an error message, bounded.
//!
//! An error that quotes what it was given (a model name, an endpoint id, a path) must not
//! grow with it: a 100 KB model name came back whole in a 100 KB 404, and a 70 KB endpoint
//! id in a 400 (found by a breaker). [`echo`] keeps the first [`ECHO_MAX_BYTES`] and says
//! how long the text was, so the message still names the field and the reason.

use std::borrow::Cow;

/// Longest piece of quoted text an error message repeats, in bytes.
pub const ECHO_MAX_BYTES: usize = 256;

/// `text` as an error message quotes it: whole up to [`ECHO_MAX_BYTES`] bytes, else its
/// first bytes up to that many, cut on a character boundary, then `…` and its length in
/// bytes (`"mmm…m… (100000 bytes in all)"`).
pub fn echo(text: &str) -> Cow<'_, str> {
    echo_within(text, ECHO_MAX_BYTES)
}

/// [`echo`] with a bound of `max_bytes` instead of [`ECHO_MAX_BYTES`] (a snapshot's decode
/// error, a config value in kvroute-cp's errors).
pub fn echo_within(text: &str, max_bytes: usize) -> Cow<'_, str> {
    if text.len() <= max_bytes {
        return text.into();
    }
    let mut cut = max_bytes;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let kept = text.get(..cut).unwrap_or_default();
    format!("{kept}… ({} bytes in all)", text.len()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text is cut at [`ECHO_MAX_BYTES`] on a character boundary, with its length; shorter
    /// text is repeated whole.
    #[test]
    fn long_text_is_cut_with_its_length() {
        assert_eq!(echo("gpt-x"), "gpt-x");
        let at_limit = "m".repeat(ECHO_MAX_BYTES);
        assert_eq!(echo(&at_limit), at_limit.as_str());
        let long = "m".repeat(100_000);
        assert_eq!(
            echo(&long),
            format!("{}… (100000 bytes in all)", "m".repeat(256))
        );
        // 255 ASCII bytes then a 3-byte character that straddles the limit: cut before it.
        let straddle = format!("{}东东", "a".repeat(255));
        assert_eq!(
            echo(&straddle),
            format!("{}… (261 bytes in all)", "a".repeat(255))
        );
        assert_eq!(echo_within("东东", 4), "东… (6 bytes in all)");
        assert_eq!(echo_within("东东", 0), "… (6 bytes in all)");
    }
}
