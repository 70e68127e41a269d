//! Stop strings over streamed text: finds the earliest stop string in the text so far, and holds
//! back the tail that could still become one, so a client never sees part of a stop string.

/// Where the text must be cut, if a stop string occurs: the byte index of its start.
pub fn find_stop(text: &str, stops: &[String], search_from: usize) -> Option<usize> {
    let mut best: Option<usize> = None;
    for s in stops.iter().filter(|s| !s.is_empty()) {
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
        for k in (1..s.len()).rev() {
            if k <= text.len()
                && text.is_char_boundary(text.len() - k)
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
    }
}
