//! The benchmark's output: a table for people, one JSON object for machines. Both carry the
//! same numbers under the same keys (documented in docs/benchmarks.md).

use std::fmt::Write;

/// One measured figure.
pub struct Figure {
    /// JSON key.
    pub key: &'static str,
    /// Value.
    pub value: f64,
}

/// One table row: our figure beside the floor or peer measured in the same run.
pub struct Row {
    pub what: String,
    pub ours: String,
    pub beside: String,
    pub ratio: String,
    pub target: String,
}

#[derive(Default)]
pub struct Report {
    pub figures: Vec<Figure>,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

impl Report {
    pub fn fig(&mut self, key: &'static str, value: f64) -> f64 {
        self.figures.push(Figure { key, value });
        value
    }

    pub fn row(
        &mut self,
        what: impl Into<String>,
        ours: String,
        beside: String,
        ratio: String,
        target: &str,
    ) {
        self.rows.push(Row {
            what: what.into(),
            ours,
            beside,
            ratio,
            target: target.to_string(),
        });
    }

    pub fn table(&self, header: &str) -> String {
        let cols = [
            "what",
            "shmstore",
            "floor / peer, same run",
            "ratio",
            "target",
        ];
        let cells: Vec<[&str; 5]> = self
            .rows
            .iter()
            .map(|r| [r.what.as_str(), &r.ours, &r.beside, &r.ratio, &r.target])
            .collect();
        let mut w = [0usize; 5];
        for row in std::iter::once(&cols).chain(cells.iter()) {
            for (i, c) in row.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let _ = writeln!(out, "{header}\n");
        let line = |out: &mut String, row: &[&str; 5]| {
            let _ = writeln!(
                out,
                "| {:<a$} | {:>b$} | {:<c$} | {:>d$} | {:<e$} |",
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                a = w[0],
                b = w[1],
                c = w[2],
                d = w[3],
                e = w[4]
            );
        };
        line(&mut out, &cols);
        let _ = writeln!(
            out,
            "|{}|{}:|{}|{}:|{}|",
            "-".repeat(w[0] + 2),
            "-".repeat(w[1] + 1),
            "-".repeat(w[2] + 2),
            "-".repeat(w[3] + 1),
            "-".repeat(w[4] + 2)
        );
        for r in &cells {
            line(&mut out, r);
        }
        for n in &self.notes {
            let _ = writeln!(out, "\n{n}");
        }
        out
    }

    /// One JSON object: the machine description (strings), then every figure under its
    /// key, in the order measured (non-finite figures are `null`).
    pub fn json(&self, machine: &[(&str, String)]) -> String {
        struct Out<'a>(&'a [(&'a str, String)], &'a [Figure]);
        impl serde::Serialize for Out<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeMap;
                let mut map = s.serialize_map(Some(self.0.len() + self.1.len()))?;
                for (k, v) in self.0 {
                    map.serialize_entry(k, v)?;
                }
                for f in self.1 {
                    let v = f.value.is_finite().then(|| round(f.value));
                    map.serialize_entry(f.key, &v)?;
                }
                map.end()
            }
        }
        serde_json::to_string(&Out(machine, &self.figures)).expect("strings and numbers encode")
    }
}

fn round(v: f64) -> f64 {
    if v.abs() >= 100.0 {
        v.round()
    } else {
        (v * 1000.0).round() / 1000.0
    }
}

/// Formats nanoseconds for people.
pub fn ns(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} ms", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.1} us", v / 1e3)
    } else {
        format!("{v:.0} ns")
    }
}

/// Ratio text: "0.96x", or "1/404" when ours is a small fraction of the floor.
pub fn ratio(a: f64, b: f64) -> String {
    if b == 0.0 || a == 0.0 {
        "-".into()
    } else if a / b < 0.1 {
        format!("1/{:.0}", b / a)
    } else {
        format!("{:.2}x", a / b)
    }
}
