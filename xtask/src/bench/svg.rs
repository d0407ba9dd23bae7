//! Bar charts as plain SVG: one group of bars per placement, one bar per
//! variant at its median, a whisker from the smallest to the largest run.

use std::fmt::Write as _;

/// One bar.
#[derive(Debug, Clone)]
pub struct Bar {
    /// Legend entry (`ebpf hbone`...).
    pub label: String,
    /// Fill colour.
    pub color: &'static str,
    /// Median.
    pub value: f64,
    /// Smallest run.
    pub min: f64,
    /// Largest run.
    pub max: f64,
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 400.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 90.0;

/// Colour of a variant, the same in every chart.
pub fn color(mode: &str, protocol: &str) -> &'static str {
    match (mode, protocol) {
        ("direct", _) => "#7f7f7f",
        ("iptables", "plain") => "#e69f00",
        ("ebpf", "plain") => "#0072b2",
        ("iptables", _) => "#f5d08a",
        ("ztunnel", _) => "#009e73",
        _ => "#6cc3f0",
    }
}

/// A grouped bar chart.
pub fn bar_chart(title: &str, unit: &str, groups: &[(String, Vec<Bar>)]) -> String {
    let top_value = groups
        .iter()
        .flat_map(|(_, bars)| bars.iter().map(|b| b.max.max(b.value)))
        .fold(0.0_f64, f64::max);
    let (axis_max, step) = nice_axis(top_value);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let y = |v: f64| TOP + plot_h - (v / axis_max).clamp(0.0, 1.0) * plot_h;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    // Grid and y axis.
    let mut tick = 0.0;
    while tick <= axis_max + step / 2.0 {
        let ty = y(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#dddddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            ty + 4.0,
            short(tick)
        );
        tick += step;
    }
    let _ = writeln!(
        svg,
        r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + plot_h / 2.0,
        escape(unit)
    );
    let group_w = plot_w / groups.len().max(1) as f64;
    let mut legend: Vec<(String, &'static str)> = Vec::new();
    for (g, (name, bars)) in groups.iter().enumerate() {
        let gx = LEFT + g as f64 * group_w;
        let bar_w = group_w * 0.8 / bars.len().max(1) as f64;
        for (i, bar) in bars.iter().enumerate() {
            let x = gx + group_w * 0.1 + i as f64 * bar_w;
            let top = y(bar.value);
            let _ = writeln!(
                svg,
                r#"<rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
                x + 2.0,
                bar_w - 4.0,
                (TOP + plot_h - top).max(0.0),
                bar.color,
                escape(&bar.label),
                short(bar.value)
            );
            let cx = x + bar_w / 2.0;
            if bar.max > bar.min {
                let _ = writeln!(
                    svg,
                    r##"<line x1="{cx:.1}" y1="{:.1}" x2="{cx:.1}" y2="{:.1}" stroke="#333333"/>"##,
                    y(bar.min),
                    y(bar.max)
                );
            }
            let _ = writeln!(
                svg,
                r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"#,
                y(bar.max.max(bar.value)) - 4.0,
                short(bar.value)
            );
            if !legend.iter().any(|(l, _)| *l == bar.label) {
                legend.push((bar.label.clone(), bar.color));
            }
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13">{}</text>"#,
            gx + group_w / 2.0,
            TOP + plot_h + 20.0,
            escape(name)
        );
    }
    let _ = writeln!(
        svg,
        r##"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333333"/>"##,
        TOP + plot_h,
        WIDTH - RIGHT,
        TOP + plot_h
    );
    let legend_w = (WIDTH - LEFT - RIGHT) / legend.len().max(1) as f64;
    for (i, (label, color)) in legend.iter().enumerate() {
        let lx = LEFT + i as f64 * legend_w;
        let ly = HEIGHT - 30.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{color}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 10.0,
            lx + 16.0,
            escape(label)
        );
    }
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="10" fill="#666666">bar: median over rounds; whisker: smallest to largest run</text>"##,
        WIDTH - RIGHT,
        HEIGHT - 8.0
    );
    svg.push_str("</svg>\n");
    svg
}

/// An axis maximum at or above `max` and a tick step: 1, 2 or 5 times a
/// power of ten, about five ticks.
fn nice_axis(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.2);
    }
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

/// A short label: three significant digits, `k`/`M` for large values.
fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.3}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else {
        super::report::sig3(v)
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_is_round_and_covers_the_maximum() {
        assert_eq!(nice_axis(9.3), (10.0, 2.0));
        assert_eq!(nice_axis(23_000.0), (25_000.0, 5000.0));
        assert_eq!(nice_axis(0.0), (1.0, 0.2));
    }

    #[test]
    fn chart_is_one_svg_with_every_bar_and_escaped_text() {
        let bar = |label: &str, value| Bar {
            label: label.into(),
            color: color("ebpf", "plain"),
            value,
            min: value * 0.9,
            max: value * 1.1,
        };
        let svg = bar_chart(
            "p99 <latency>",
            "us",
            &[
                (
                    "same-node".into(),
                    vec![bar("direct", 10.0), bar("ebpf", 20.0)],
                ),
                ("cross-node".into(), vec![bar("direct", 12.0)]),
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(
            svg.matches("<rect x=").count(),
            3 + 2,
            "3 bars + 2 legend keys"
        );
        assert!(svg.contains("p99 &lt;latency&gt;"));
    }
}
