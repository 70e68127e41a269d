//! The prompts `quire bench --spec` measures speculative decoding on: a ~250-token passage to
//! repeat, to lightly edit, or to continue (the cases prompt lookup is for). Here so the bench and
//! the engine's replay example (examples/spec_trace.rs) read the same text.

/// About 250 tokens of plain prose.
pub const PASSAGE: &str = "The old lighthouse stood on the northern cliff for two hundred years. \
Every night its keeper climbed the spiral stairs, trimmed the wick and polished the great lens, \
so that the fishing boats could find their way home through fog and storm. When the keeper grew \
old, his daughter took over the work, and she kept the light burning for forty more winters. \
The village below depended on that light. Fishermen left the harbour before dawn and came back \
after dark, and on winter evenings the sea turned grey and wild within minutes. More than once \
the beam was the only thing that told a crew where the rocks were. In the spring of the great \
flood the keeper's daughter stayed awake for three nights, feeding the lamp with the last of \
the oil, while the water rose around the foot of the tower. When the weather finally cleared, \
every boat had returned, and the villagers climbed the hill to thank her. Today the lighthouse \
is a museum, and children who visit it can still climb the spiral stairs and look out over the \
water that the light once guarded.";

/// (name, prompt) of the three cases, in the bench's order.
pub fn prompts() -> Vec<(&'static str, String)> {
    vec![
        (
            "repeat",
            format!("Repeat the following passage word for word.\n\n{PASSAGE}"),
        ),
        (
            "edit",
            format!(
                "Rewrite the following passage, replacing 'lighthouse' with 'tower' and \
                 changing nothing else.\n\n{PASSAGE}"
            ),
        ),
        (
            "continue",
            format!("{PASSAGE}\n\nNow write the passage above again:\n\n"),
        ),
    ]
}
