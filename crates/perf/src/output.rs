//! Result writers. Every toolkit command prints one of four formats: a markdown table for people
//! (llama-bench's look, so the two tools' tables sit side by side), CSV for spreadsheets, and JSON
//! or JSONL for programs (`quire compare`, `quire roofline`). Records are `serde_json` objects so
//! one record type feeds every format and field order is kept as written.

use std::fmt::Write as _;
use std::str::FromStr;

use serde_json::{Map, Value};

use crate::PerfError;

/// An output format of the toolkit's commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Md,
    Csv,
    Json,
    Jsonl,
}

impl FromStr for Format {
    type Err = PerfError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "md" | "markdown" => Ok(Format::Md),
            "csv" => Ok(Format::Csv),
            "json" => Ok(Format::Json),
            "jsonl" => Ok(Format::Jsonl),
            other => Err(PerfError::Parse(format!(
                "unknown output format '{other}' (md, csv, json, jsonl)"
            ))),
        }
    }
}

/// How a markdown column is aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A table of already formatted cells, for markdown and CSV.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub headers: Vec<String>,
    pub align: Vec<Align>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns named `headers`; those listed in `right` are right-aligned (numbers).
    pub fn new(headers: &[&str], right: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            align: headers
                .iter()
                .map(|h| {
                    if right.contains(h) {
                        Align::Right
                    } else {
                        Align::Left
                    }
                })
                .collect(),
            rows: Vec::new(),
        }
    }

    pub fn push(&mut self, row: Vec<String>) {
        debug_assert_eq!(row.len(), self.headers.len());
        self.rows.push(row);
    }

    /// A GitHub-flavoured markdown table with padded columns (`| a | b |`, `| --- | ---: |`).
    pub fn markdown(&self) -> String {
        let cols = self.headers.len();
        let esc =
            |r: &Vec<String>| -> Vec<String> { r.iter().map(|c| c.replace('|', "\\|")).collect() };
        let rows: Vec<Vec<String>> = self.rows.iter().map(esc).collect();
        let width = |c: usize| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .chain([self.headers[c].chars().count(), 3])
                .max()
                .unwrap_or(3)
        };
        let widths: Vec<usize> = (0..cols).map(width).collect();
        let pad = |s: &str, c: usize| {
            let fill = widths[c].saturating_sub(s.chars().count());
            match self.align.get(c) {
                Some(Align::Right) => format!("{}{s}", " ".repeat(fill)),
                _ => format!("{s}{}", " ".repeat(fill)),
            }
        };
        let mut out = String::new();
        let line = |out: &mut String, cells: &[String]| {
            out.push('|');
            for (c, cell) in cells.iter().enumerate().take(cols) {
                let _ = write!(out, " {} |", pad(cell, c));
            }
            out.push('\n');
        };
        line(&mut out, &self.headers);
        out.push('|');
        for (c, w) in widths.iter().enumerate() {
            let rule = match self.align.get(c) {
                Some(Align::Right) => format!("{}:", "-".repeat(w - 1)),
                _ => "-".repeat(*w),
            };
            let _ = write!(out, " {rule} |");
        }
        out.push('\n');
        for r in &rows {
            line(&mut out, r);
        }
        out
    }

    /// RFC 4180 CSV with a header line.
    pub fn csv(&self) -> String {
        let mut out = csv_line(&self.headers);
        for r in &self.rows {
            out.push_str(&csv_line(r));
        }
        out
    }
}

/// One CSV record (with its line ending): fields holding a comma, quote, line break or edge
/// space are quoted, quotes doubled.
pub fn csv_line<S: AsRef<str>>(fields: &[S]) -> String {
    let mut out = String::new();
    for (i, f) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let f = f.as_ref();
        let quote = f.contains([',', '"', '\n', '\r']) || f.starts_with(' ') || f.ends_with(' ');
        if quote {
            out.push('"');
            out.push_str(&f.replace('"', "\"\""));
            out.push('"');
        } else {
            out.push_str(f);
        }
    }
    out.push('\n');
    out
}

/// A JSON value as one CSV cell: strings bare, null empty, arrays and objects as JSON text.
pub fn csv_cell(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        other => other.to_string(),
    }
}

/// CSV of JSON objects: the columns are every key, in order of first appearance.
pub fn records_csv(records: &[Map<String, Value>]) -> String {
    let mut cols: Vec<&str> = Vec::new();
    for r in records {
        for k in r.keys() {
            if !cols.contains(&k.as_str()) {
                cols.push(k);
            }
        }
    }
    let mut out = csv_line(&cols);
    for r in records {
        let cells: Vec<String> = cols
            .iter()
            .map(|c| r.get(*c).map(csv_cell).unwrap_or_default())
            .collect();
        out.push_str(&csv_line(&cells));
    }
    out
}

/// A pretty-printed JSON array of the records (llama-bench's `-o json` shape).
pub fn records_json(records: &[Map<String, Value>]) -> String {
    let arr = Value::Array(records.iter().cloned().map(Value::Object).collect());
    let mut s = serde_json::to_string_pretty(&arr).expect("JSON values always serialize");
    s.push('\n');
    s
}

/// One compact JSON object per line.
pub fn records_jsonl(records: &[Map<String, Value>]) -> String {
    let mut s = String::new();
    for r in records {
        s.push_str(&serde_json::to_string(r).expect("JSON values always serialize"));
        s.push('\n');
    }
    s
}

/// Reads records back from any JSON shape the toolkit (or llama-bench) writes: an array of
/// objects, one object, or JSONL.
pub fn parse_records(text: &str) -> Result<Vec<Map<String, Value>>, PerfError> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let objects = |v: Value| -> Result<Vec<Map<String, Value>>, PerfError> {
        match v {
            Value::Array(a) => a
                .into_iter()
                .map(|x| match x {
                    Value::Object(o) => Ok(o),
                    _ => Err(PerfError::Parse("array element is not an object".into())),
                })
                .collect(),
            Value::Object(o) => Ok(vec![o]),
            _ => Err(PerfError::Parse("expected a JSON object or array".into())),
        }
    };
    match serde_json::from_str::<Value>(text) {
        Ok(v) => objects(v),
        Err(whole) => {
            let mut out = Vec::new();
            for (i, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let v: Value = serde_json::from_str(line).map_err(|e| {
                    PerfError::Parse(format!(
                        "not JSON ({whole}) nor JSONL (line {}: {e})",
                        i + 1
                    ))
                })?;
                out.extend(objects(v)?);
            }
            Ok(out)
        }
    }
}

/// Chart axis numbers without trailing noise: 0.01, 0.5, 2, 40, 1.2k.
pub fn short_number(v: f64) -> String {
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if v >= 1e3 {
        format!("{}k", trim(format!("{:.3}", v / 1e3)))
    } else if v >= 1.0 {
        trim(format!("{v:.2}"))
    } else {
        trim(format!("{v:.3}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Vec<Map<String, Value>> {
        let r = |v: Value| v.as_object().unwrap().clone();
        vec![
            r(
                json!({"model_type": "llama 135M Q4_1", "n_prompt": 512, "avg_ts": 293.125,
                     "samples_ts": [290.5, 295.75], "note": "a, \"quoted\"\nline", "ok": true}),
            ),
            r(
                json!({"model_type": " lead space", "n_prompt": 0, "avg_ts": 1.5e-3,
                     "samples_ts": [], "extra": null}),
            ),
        ]
    }

    #[test]
    fn json_round_trip() {
        let recs = sample();
        assert_eq!(parse_records(&records_json(&recs)).unwrap(), recs);
        assert_eq!(parse_records(&records_jsonl(&recs)).unwrap(), recs);
        let v: Value = serde_json::from_str(&records_json(&recs)).unwrap();
        assert_eq!(v[0]["samples_ts"][1], 295.75);
        assert_eq!(records_jsonl(&recs).lines().count(), 2);
        assert!(parse_records("{\"a\": 1}\nnot json").is_err());
    }

    #[test]
    fn csv_round_trip_with_an_independent_parser() {
        let recs = sample();
        let text = records_csv(&recs);
        let mut rd = csv::ReaderBuilder::new()
            .trim(csv::Trim::None)
            .from_reader(text.as_bytes());
        let headers: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        assert_eq!(
            headers,
            [
                "model_type",
                "n_prompt",
                "avg_ts",
                "samples_ts",
                "note",
                "ok",
                "extra"
            ]
        );
        let rows: Vec<csv::StringRecord> = rd.records().map(|r| r.unwrap()).collect();
        assert_eq!(rows.len(), 2);
        assert_eq!(&rows[0][0], "llama 135M Q4_1");
        assert_eq!(rows[0][2].parse::<f64>().unwrap(), 293.125);
        let samples: Vec<f64> = serde_json::from_str(&rows[0][3]).unwrap();
        assert_eq!(samples, [290.5, 295.75]);
        assert_eq!(&rows[0][4], "a, \"quoted\"\nline");
        assert_eq!(&rows[1][0], " lead space");
        assert_eq!(rows[1][2].parse::<f64>().unwrap(), 1.5e-3);
        assert_eq!((&rows[1][4], &rows[1][6]), ("", ""));
    }

    #[test]
    fn table_csv_and_markdown() {
        let mut t = Table::new(&["model", "t/s"], &["t/s"]);
        t.push(vec!["llama 135M".into(), "293.12 ± 1.40".into()]);
        t.push(vec!["a|b".into(), "1.00 ± 0.00".into()]);
        let text = t.csv();
        let mut rd = csv::Reader::from_reader(text.as_bytes());
        let rows: Vec<csv::StringRecord> = rd.records().map(|r| r.unwrap()).collect();
        assert_eq!(&rows[0][1], "293.12 ± 1.40");
        let md = t.markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[1].ends_with(": |"), "{}", lines[1]);
        let cells: Vec<&str> = lines[2]
            .trim_matches('|')
            .split(" | ")
            .map(str::trim)
            .collect();
        assert_eq!(cells, ["llama 135M", "293.12 ± 1.40"]);
        // Every line has the same width in characters.
        let w: Vec<usize> = lines.iter().map(|l| l.chars().count()).collect();
        assert!(w.iter().all(|&x| x == w[0]), "{md}");
    }

    #[test]
    fn formats_parse() {
        assert_eq!("MD".parse::<Format>().unwrap(), Format::Md);
        assert_eq!("jsonl".parse::<Format>().unwrap(), Format::Jsonl);
        assert!("xml".parse::<Format>().is_err());
    }
}
