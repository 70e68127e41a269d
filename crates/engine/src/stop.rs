//! Stop strings over streamed text: finds the earliest stop string in the text so far, and holds
//! back the tail that could still become one, so a client never sees part of a stop string. Both
//! run on the engine thread once per token, so both look only at the end of the text: the new
//! text plus a stop string's length before it, never the whole output or a whole long stop
//! string again.

/// Where the text must be cut, if a stop string occurs: the byte index of its start.
pub fn find_stop(text: &str, stops: &[String], search_from: usize) -> Option<usize> {
    let mut best: Option<usize> = None;
    // A stop longer than the text cannot occur in it (and a searcher for it costs its length).
    for s in stops
        .iter()
        .filter(|s| !s.is_empty() && s.len() <= text.len())
    {
        // A match may start before `search_from` if it ends after it.
        let mut from = search_from.saturating_sub(s.len().saturating_sub(1));
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(i) = text[from..].find(s.as_str()) {
            let at = from + i;
            best = Some(best.map_or(at, |b| b.min(at)));
        }
    }
    best
}

/// Length of the longest suffix of `text` that is a proper prefix of some stop string: that many
/// bytes must be held back from the stream for now.
pub fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        // Only prefixes no longer than the text can match: start there, not at the stop's length.
        let longest = s.len().saturating_sub(1).min(text.len());
        for k in (hold + 1..=longest).rev() {
            if text.is_char_boundary(text.len() - k)
                && s.is_char_boundary(k)
                && text.ends_with(&s[..k])
            {
                hold = hold.max(k);
                break;
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_earliest_stop_across_the_boundary() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(find_stop("abc\n\nEND", &stops, 0), Some(3));
        assert_eq!(find_stop("abcEN", &stops, 3), None);
        assert_eq!(find_stop("abcEND", &stops, 5), Some(3));
    }

    #[test]
    fn holds_back_possible_prefixes() {
        let stops = vec!["END".to_string()];
        assert_eq!(held_back("abcE", &stops), 1);
        assert_eq!(held_back("abcEN", &stops), 2);
        assert_eq!(held_back("abc", &stops), 0);
        assert_eq!(held_back("é", &["éx".to_string()]), 2);
        assert_eq!(held_back("abE", &["E".to_string(), "END".to_string()]), 1);
        assert_eq!(held_back("aEN", &["NX".to_string(), "ENX".to_string()]), 2);
    }

    /// Long stop strings cost per token only what the short text can match. Before, each call
    /// walked every prefix length of every stop (16 x 1 MB here, over 200 tokens: ~3 G steps, over 30 s).
    #[test]
    fn long_stop_strings_cost_only_the_text_tail() {
        let stops: Vec<String> = (0..16)
            .map(|i| format!("{i}{}", "x".repeat(1 << 20)))
            .collect();
        let start = std::time::Instant::now();
        let mut text = String::new();
        for _ in 0..200 {
            text.push_str("ab ");
            assert_eq!(held_back(&text, &stops), 0);
            assert_eq!(find_stop(&text, &stops, text.len().saturating_sub(3)), None);
        }
        text.push('3');
        assert_eq!(held_back(&text, &stops), 1);
        let took = start.elapsed();
        assert!(took.as_secs_f64() < 3.0, "200 tokens took {took:?}");
    }
}
