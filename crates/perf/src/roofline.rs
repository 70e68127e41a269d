//! The roofline chart (Williams, Waterman & Patterson, CACM 2009): attainable FLOP/s against
//! arithmetic intensity (FLOP per byte moved), on log–log axes. Each ceiling is a roof: memory
//! bandwidth is the slanted line `bw × intensity`, each compute peak a flat line. A measured point
//! under the slanted roof is memory-bound, under a flat one compute-bound; its distance below the
//! roof is what an optimization can still win. Drawn as SVG with plotters (SVG text elements, so
//! no fonts are needed at build or run time).

use plotters::prelude::*;

use crate::PerfError;

/// A measured kernel or benchmark run.
#[derive(Debug, Clone, PartialEq)]
pub struct RoofPoint {
    pub label: String,
    /// FLOP per byte.
    pub intensity: f64,
    /// Achieved GFLOP/s.
    pub gflops: f64,
    /// Group name (the legend entry and colour), e.g. "bench" or "profile decode".
    pub group: String,
}

/// A flat compute roof.
#[derive(Debug, Clone, PartialEq)]
pub struct Roof {
    pub label: String,
    pub gflops: f64,
}

/// The chart's ceilings and points.
#[derive(Debug, Clone, PartialEq)]
pub struct Roofline {
    pub title: String,
    pub mem_bw_gbps: f64,
    pub roofs: Vec<Roof>,
    pub points: Vec<RoofPoint>,
}

impl Roofline {
    /// Attainable GFLOP/s at `intensity` under the highest roof.
    pub fn attainable(&self, intensity: f64) -> f64 {
        let peak = self.roofs.iter().map(|r| r.gflops).fold(0.0, f64::max);
        (self.mem_bw_gbps * intensity).min(peak)
    }

    /// Renders the chart as an SVG document.
    pub fn svg(&self, width: u32, height: u32) -> Result<String, PerfError> {
        let err = |e: &dyn std::fmt::Display| PerfError::Chart(e.to_string());
        let peak = self.roofs.iter().map(|r| r.gflops).fold(0.0, f64::max);
        let low = self.roofs.iter().map(|r| r.gflops).fold(peak, f64::min);
        let pts = self
            .points
            .iter()
            .filter(|p| p.intensity > 0.0 && p.gflops > 0.0);
        let ridge = peak / self.mem_bw_gbps;
        let xs = pts
            .clone()
            .map(|p| p.intensity)
            .chain([ridge, low / self.mem_bw_gbps]);
        let ys = pts.clone().map(|p| p.gflops).chain([peak]);
        let x0 = xs.clone().fold(f64::INFINITY, f64::min) / 4.0;
        let x1 = xs.fold(0.0, f64::max) * 8.0;
        let y0 = ys
            .clone()
            .fold(f64::INFINITY, f64::min)
            .min(self.mem_bw_gbps * x0)
            / 2.0;
        let y1 = ys.fold(0.0, f64::max) * 3.0;

        let mut out = String::new();
        {
            let root = SVGBackend::with_string(&mut out, (width, height)).into_drawing_area();
            root.fill(&WHITE).map_err(|e| err(&e))?;
            let mut chart = ChartBuilder::on(&root)
                .caption(&self.title, ("sans-serif", 20))
                .margin(16)
                .x_label_area_size(44)
                .y_label_area_size(64)
                .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .x_desc("arithmetic intensity (FLOP/byte)")
                .y_desc("GFLOP/s")
                .x_label_formatter(&|v| crate::output::short_number(*v))
                .y_label_formatter(&|v| crate::output::short_number(*v))
                .draw()
                .map_err(|e| err(&e))?;

            // Memory roof up to the highest compute roof.
            let bw = self.mem_bw_gbps;
            chart
                .draw_series(LineSeries::new(
                    [(x0, bw * x0), (ridge, peak)],
                    BLACK.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(format!("memory {bw:.1} GB/s"))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
            let roof_colors = [
                RGBColor(200, 60, 20),
                RGBColor(120, 60, 160),
                RGBColor(20, 120, 60),
            ];
            for (i, r) in self.roofs.iter().enumerate() {
                let c = roof_colors[i % roof_colors.len()];
                let start = r.gflops / bw;
                chart
                    .draw_series(LineSeries::new(
                        [(start, r.gflops), (x1, r.gflops)],
                        c.stroke_width(2),
                    ))
                    .map_err(|e| err(&e))?
                    .label(format!("{} {:.1} GFLOP/s", r.label, r.gflops))
                    .legend(move |(x, y)| {
                        PathElement::new([(x, y), (x + 20, y)], c.stroke_width(2))
                    });
            }

            let point_colors = [BLUE, RGBColor(230, 140, 0), MAGENTA, CYAN, GREEN, RED];
            let mut groups: Vec<&str> = Vec::new();
            for p in &self.points {
                if !groups.contains(&p.group.as_str()) {
                    groups.push(&p.group);
                }
            }
            for (gi, g) in groups.iter().enumerate() {
                let c = point_colors[gi % point_colors.len()];
                let members: Vec<&RoofPoint> = self
                    .points
                    .iter()
                    .filter(|p| p.group == *g && p.intensity > 0.0 && p.gflops > 0.0)
                    .collect();
                chart
                    .draw_series(
                        members
                            .iter()
                            .map(|p| Circle::new((p.intensity, p.gflops), 4, c.filled())),
                    )
                    .map_err(|e| err(&e))?
                    .label(g.to_string())
                    .legend(move |(x, y)| Circle::new((x + 10, y), 4, c.filled()));
                chart
                    .draw_series(members.iter().map(|p| {
                        Text::new(
                            p.label.clone(),
                            (p.intensity * 1.08, p.gflops * 1.05),
                            ("sans-serif", 11).into_font().color(&c),
                        )
                    }))
                    .map_err(|e| err(&e))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
            root.present().map_err(|e| err(&e))?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_an_svg_with_points_and_roofs() {
        let r = Roofline {
            title: "test machine".into(),
            mem_bw_gbps: 20.0,
            roofs: vec![
                Roof {
                    label: "fp32".into(),
                    gflops: 150.0,
                },
                Roof {
                    label: "q4_1".into(),
                    gflops: 60.0,
                },
            ],
            points: vec![
                RoofPoint {
                    label: "tg128".into(),
                    intensity: 3.1,
                    gflops: 30.0,
                    group: "bench".into(),
                },
                RoofPoint {
                    label: "pp512".into(),
                    intensity: 1500.0,
                    gflops: 40.0,
                    group: "bench".into(),
                },
            ],
        };
        let svg = r.svg(800, 500).unwrap();
        assert!(
            svg.starts_with("<svg") || svg.starts_with("<?xml"),
            "{}",
            &svg[..60]
        );
        assert!(svg.contains("tg128") && svg.contains("memory 20.0 GB/s"));
        assert!(svg.contains("<circle"));
        assert_eq!(r.attainable(1.0), 20.0);
        assert_eq!(r.attainable(100.0), 150.0);
        assert_eq!(crate::output::short_number(0.25), "0.25");
        assert_eq!(crate::output::short_number(2000.0), "2k");
    }
}
