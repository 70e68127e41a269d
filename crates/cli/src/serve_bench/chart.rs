//! The SVG chart: latency over time. TTFT and end-to-end latency of each request as points at its
//! completion time, ITLs as small points at their chunk's arrival, the three phases shaded.
//! Log-scale latency axis (ITLs of ms and E2E of seconds share it).

use anyhow::{anyhow, Result};
use plotters::prelude::*;

use super::load::RequestRecord;

/// At most this many ITL points are drawn (evenly thinned beyond), to keep the file small.
const MAX_ITL_POINTS: usize = 20_000;

pub struct ChartInput<'a> {
    pub title: String,
    pub records: &'a [RequestRecord],
    pub ramp_s: f64,
    pub duration_s: f64,
    pub end_s: f64,
}

pub fn svg(c: &ChartInput, width: u32, height: u32) -> Result<String> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing the chart: {e}");
    let ok: Vec<&RequestRecord> = c.records.iter().filter(|r| r.ok()).collect();
    let ttft: Vec<(f64, f64)> = ok
        .iter()
        .filter_map(|r| Some((r.o.done_s, r.o.ttft_ms?)))
        .collect();
    let e2e: Vec<(f64, f64)> = ok.iter().map(|r| (r.o.done_s, r.e2e_ms())).collect();
    let n_itl: usize = ok.iter().map(|r| r.o.itl_ms.len()).sum();
    let every = n_itl.div_ceil(MAX_ITL_POINTS).max(1);
    let itl: Vec<(f64, f64)> = ok
        .iter()
        .flat_map(|r| {
            r.o.itl_ms
                .iter()
                .enumerate()
                .filter_map(|(j, &g)| Some((*r.o.chunk_s.get(j + 1)?, g)))
        })
        .enumerate()
        .filter(|(i, _)| i % every == 0)
        .map(|(_, p)| p)
        .collect();

    let x1 = c.end_s.max(c.duration_s).max(1e-3) * 1.02;
    let ys = ttft.iter().chain(&e2e).chain(&itl).map(|p| p.1);
    let y_max = ys.clone().fold(1.0_f64, f64::max) * 2.0;
    let y_min = ys
        .filter(|&y| y > 0.0)
        .fold(f64::INFINITY, f64::min)
        .min(y_max / 10.0)
        .max(1e-3)
        / 2.0;
    let clamp = |(x, y): (f64, f64)| (x, y.max(y_min));

    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&c.title, ("sans-serif", 18))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x1, (y_min..y_max).log_scale())
            .map_err(|e| err(&e))?;

        // Phase shading first, under everything else.
        let phases = [
            ("ramp", 0.0, c.ramp_s, RGBColor(255, 236, 200)),
            ("steady", c.ramp_s, c.duration_s, RGBColor(220, 240, 220)),
            ("tail", c.duration_s, x1, RGBColor(225, 228, 245)),
        ];
        for (name, a, b, color) in phases {
            if b <= a {
                continue;
            }
            chart
                .draw_series([Rectangle::new([(a, y_min), (b, y_max)], color.filled())])
                .map_err(|e| err(&e))?;
            chart
                .draw_series([Text::new(
                    name.to_string(),
                    (a + (b - a) * 0.02, y_max / 1.3),
                    ("sans-serif", 13).into_font().color(&RGBColor(90, 90, 90)),
                )])
                .map_err(|e| err(&e))?;
        }

        chart
            .configure_mesh()
            .x_desc("seconds since start")
            .y_desc("latency (ms)")
            .y_label_formatter(&|v| quire_perf::output::short_number(*v))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| err(&e))?;

        let grey = RGBColor(110, 110, 110);
        chart
            .draw_series(
                itl.iter()
                    .map(|&p| Circle::new(clamp(p), 1, grey.mix(0.5).filled())),
            )
            .map_err(|e| err(&e))?
            .label("ITL")
            .legend(move |(x, y)| Circle::new((x + 10, y), 2, grey.filled()));
        let blue = RGBColor(30, 90, 200);
        chart
            .draw_series(
                ttft.iter()
                    .map(|&p| Circle::new(clamp(p), 3, blue.filled())),
            )
            .map_err(|e| err(&e))?
            .label("TTFT")
            .legend(move |(x, y)| Circle::new((x + 10, y), 3, blue.filled()));
        let red = RGBColor(210, 50, 40);
        chart
            .draw_series(e2e.iter().map(|&p| Circle::new(clamp(p), 3, red.filled())))
            .map_err(|e| err(&e))?
            .label("E2E")
            .legend(move |(x, y)| Circle::new((x + 10, y), 3, red.filled()));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve_bench::client::Outcome;

    #[test]
    fn draws_phases_and_points() {
        let records: Vec<RequestRecord> = (0..5)
            .map(|i| RequestRecord {
                index: i,
                arrival_s: i as f64,
                send_s: i as f64,
                prompt_words: 3,
                max_tokens: 3,
                o: Outcome {
                    done_s: i as f64 + 0.5,
                    ttft_ms: Some(100.0),
                    itl_ms: vec![20.0, 0.0],
                    chunk_s: vec![i as f64 + 0.1, i as f64 + 0.12, i as f64 + 0.12],
                    output_tokens: 3,
                    ..Outcome::default()
                },
            })
            .collect();
        let c = ChartInput {
            title: "t".into(),
            records: &records,
            ramp_s: 1.0,
            duration_s: 4.0,
            end_s: 4.6,
        };
        let s = svg(&c, 600, 400).unwrap();
        assert!(s.contains("<svg") && s.contains("</svg>"));
        assert!(s.contains("steady") && s.contains("TTFT"));
        assert!(s.matches("<circle").count() >= 5 * 4);
        // No requests at all still draws.
        let c = ChartInput { records: &[], ..c };
        assert!(svg(&c, 600, 400).unwrap().contains("</svg>"));
    }
}
