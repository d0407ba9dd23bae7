//! Results: the guest's report (see `tests/vm/init.sh`) and libtest's
//! output read into per-test outcomes, and the tables printed at the end.

use std::{fmt::Write as _, time::Duration};

/// Each test's name and outcome: passed, failed, or `None` when ignored.
pub type Outcomes = Vec<(String, Option<bool>)>;

/// Each failed test's name and captured output.
pub type Failures = Vec<(String, String)>;

/// One test binary's run.
#[derive(Debug, Clone, Default)]
pub struct BinaryRun {
    /// The test target's name (`redirect_kernel`).
    pub name: String,
    /// Exit status; `None` if the run never ended (the guest died).
    pub status: Option<i32>,
    /// Wall time.
    pub seconds: u64,
    /// Each test and whether it passed.
    pub tests: Outcomes,
    /// Each failed test's captured output.
    pub failures: Failures,
    /// The binary's whole output (for failures outside any test).
    pub output: String,
}

impl BinaryRun {
    /// A finished run of `name` from its output.
    pub fn from_output(name: &str, output: String, status: Option<i32>, seconds: u64) -> Self {
        let (tests, failures) = parse_libtest(&output);
        Self {
            name: name.to_owned(),
            status,
            seconds,
            tests,
            failures,
            output,
        }
    }

    /// Passed when it exited 0 and no test failed.
    pub fn passed(&self) -> bool {
        self.status == Some(0) && self.tests.iter().all(|(_, ok)| *ok != Some(false))
    }

    fn counts(&self) -> (usize, usize) {
        let run = self.tests.iter().filter(|(_, ok)| ok.is_some()).count();
        let passed = self
            .tests
            .iter()
            .filter(|(_, ok)| *ok == Some(true))
            .count();
        (passed, run)
    }
}

/// How one kernel's run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Every binary ran and the guest reported its end.
    Completed,
    /// The time limit passed.
    TimedOut,
    /// The guest stopped reporting before the end (panic, oops): the tail
    /// of its console.
    Crashed(String),
    /// xtask was interrupted.
    Interrupted,
    /// The kernel could not be fetched or booted.
    NotRun(String),
}

/// One row of the matrix.
#[derive(Debug, Clone)]
pub struct KernelRun {
    /// `5.10`, ..., or `host`.
    pub label: String,
    /// `uname -r` (as the guest reported it).
    pub release: String,
    /// How it ended.
    pub ending: Ending,
    /// The binaries, in run order.
    pub binaries: Vec<BinaryRun>,
    /// Boot to power-off (or the host run).
    pub elapsed: Duration,
    /// Modules that failed to load.
    pub module_failures: Vec<String>,
}

impl KernelRun {
    /// An empty row.
    pub fn new(label: &str) -> Self {
        Self {
            label: label.to_owned(),
            release: String::new(),
            ending: Ending::NotRun(String::new()),
            binaries: Vec::new(),
            elapsed: Duration::ZERO,
            module_failures: Vec::new(),
        }
    }

    /// Passed when it completed and every binary passed.
    pub fn passed(&self) -> bool {
        self.ending == Ending::Completed
            && self.module_failures.is_empty()
            && self.binaries.iter().all(BinaryRun::passed)
    }

    /// Reads the guest's report (second serial port).
    pub fn read_guest_report(&mut self, report: &str) {
        let mut current: Option<(String, String)> = None;
        let mut done = false;
        for line in report.lines() {
            let line = line.trim_end_matches('\r');
            let Some(record) = line.strip_prefix("@@dp ") else {
                if let Some((_, output)) = current.as_mut() {
                    output.push_str(line);
                    output.push('\n');
                }
                continue;
            };
            let mut words = record.split_whitespace();
            match words.next() {
                Some("kernel") => self.release = words.collect::<Vec<_>>().join(" "),
                Some("module") => {
                    let file = words.next().unwrap_or_default().to_owned();
                    if words.next() != Some("0") {
                        self.module_failures.push(file);
                    }
                }
                Some("begin") => {
                    current = Some((words.next().unwrap_or_default().to_owned(), String::new()));
                }
                Some("end") => {
                    let _name = words.next();
                    let status = words.next().and_then(|s| s.parse().ok());
                    let seconds = words.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                    if let Some((name, output)) = current.take() {
                        self.binaries
                            .push(BinaryRun::from_output(&name, output, status, seconds));
                    }
                }
                Some("done") => done = true,
                _ => {}
            }
        }
        // A binary cut off by a crash: keep what it printed.
        if let Some((name, output)) = current.take() {
            self.binaries
                .push(BinaryRun::from_output(&name, output, None, 0));
        }
        if done {
            self.ending = Ending::Completed;
        }
    }

    fn result(&self) -> String {
        match &self.ending {
            Ending::Completed if self.passed() => "pass".to_owned(),
            Ending::Completed => {
                let failed: usize = self
                    .binaries
                    .iter()
                    .map(|b| {
                        let f = b.tests.iter().filter(|(_, ok)| *ok == Some(false)).count();
                        if f == 0 && !b.passed() { 1 } else { f }
                    })
                    .sum();
                format!("**FAIL** ({failed} failed)")
            }
            Ending::TimedOut => "**TIMEOUT**".to_owned(),
            Ending::Crashed(_) => "**CRASH** (guest died)".to_owned(),
            Ending::Interrupted => "interrupted".to_owned(),
            Ending::NotRun(why) => format!("**NOT RUN**: {why}"),
        }
    }

    fn counts(&self) -> (usize, usize) {
        self.binaries.iter().fold((0, 0), |(p, r), b| {
            let (bp, br) = b.counts();
            (p + bp, r + br)
        })
    }
}

/// Reads libtest's (pretty) output: every `test NAME ... ok|FAILED|ignored`
/// line, and every failed test's `---- NAME stdout ----` section.
pub fn parse_libtest(output: &str) -> (Outcomes, Failures) {
    let mut tests = Vec::new();
    for line in output.lines() {
        let Some(rest) = line.strip_prefix("test ") else {
            continue;
        };
        let Some((name, outcome)) = rest.split_once(" ... ") else {
            continue;
        };
        let outcome = match outcome.trim() {
            "ok" => Some(true),
            "FAILED" => Some(false),
            o if o.starts_with("ignored") => None,
            _ => continue,
        };
        tests.push((name.trim().to_owned(), outcome));
    }
    let mut failures = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in output.lines() {
        if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|r| r.strip_suffix(" stdout ----"))
        {
            failures.extend(current.take());
            current = Some((name.to_owned(), String::new()));
        } else if line == "failures:" || line.starts_with("test result:") {
            failures.extend(current.take());
        } else if let Some((_, text)) = current.as_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    failures.extend(current);
    for (_, text) in &mut failures {
        *text = text.trim().to_owned();
    }
    (tests, failures)
}

/// `5m 50s`.
fn minutes(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// The matrix as Markdown: one row per kernel, then passes per test binary
/// and kernel, then every failure's output.
pub fn render(runs: &[KernelRun], excluded: &[(&str, &str)], total: Duration) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| kernel | release | result | tests passed | time |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    for run in runs {
        let (passed, ran) = run.counts();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {passed}/{ran} | {} |",
            run.label,
            if run.release.is_empty() {
                "?"
            } else {
                &run.release
            },
            run.result(),
            minutes(run.elapsed)
        );
    }
    let _ = writeln!(out, "\nTotal: {}.", minutes(total));

    let mut names: Vec<&str> = Vec::new();
    for run in runs {
        for b in &run.binaries {
            if !names.contains(&b.name.as_str()) {
                names.push(&b.name);
            }
        }
    }
    if !names.is_empty() {
        let _ = write!(out, "\n| test binary |");
        for run in runs {
            let _ = write!(out, " {} |", run.label);
        }
        let _ = write!(out, "\n|---|");
        for _ in runs {
            let _ = write!(out, "---|");
        }
        out.push('\n');
        for name in names {
            let _ = write!(out, "| {name} |");
            for run in runs {
                match run.binaries.iter().find(|b| b.name == name) {
                    Some(b) => {
                        let (passed, ran) = b.counts();
                        let mark = if b.passed() { "" } else { " ✗" };
                        let _ = write!(out, " {passed}/{ran}{mark} ({}s) |", b.seconds);
                    }
                    None => out.push_str(" – |"),
                }
            }
            out.push('\n');
        }
    }
    let mut reasons: Vec<&str> = Vec::new();
    for (_, why) in excluded {
        if !reasons.contains(why) {
            reasons.push(why);
        }
    }
    for why in reasons {
        let names: Vec<String> = excluded
            .iter()
            .filter(|(_, w)| *w == why)
            .map(|(n, _)| format!("`{n}`"))
            .collect();
        let _ = writeln!(out, "\nNot in VMs ({why}): {}.", names.join(", "));
    }

    for run in runs {
        for module in &run.module_failures {
            let _ = writeln!(out, "\n### {}: module {module} did not load", run.label);
        }
        if let Ending::Crashed(console) = &run.ending {
            let _ = writeln!(
                out,
                "\n### {}: the guest died; console tail\n\n```\n{console}\n```",
                run.label
            );
        }
        for b in run.binaries.iter().filter(|b| !b.passed()) {
            if b.failures.is_empty() {
                let tail: Vec<&str> = b.output.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                let _ = writeln!(
                    out,
                    "\n### {} / {} (exit {:?})\n\n```\n{}\n```",
                    run.label,
                    b.name,
                    b.status,
                    tail.join("\n")
                );
            }
            for (test, text) in &b.failures {
                let _ = writeln!(
                    out,
                    "\n### {} / {} / {test}\n\n```\n{text}\n```",
                    run.label, b.name
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIBTEST: &str = "\nrunning 3 tests\n\
        test a ... ok\n\
        test b ... FAILED\n\
        test c ... ignored, needs a NIC\n\
        test b has been running for over 60 seconds\n\n\
        failures:\n\n\
        ---- b stdout ----\n\
        Error: cannot read the cookie\n\n\
        Caused by:\n    Protocol not available (os error 92)\n\n\
        failures:\n    b\n\n\
        test result: FAILED. 1 passed; 1 failed; 1 ignored\n";

    #[test]
    fn reads_outcomes_and_failure_output() {
        let (tests, failures) = parse_libtest(LIBTEST);
        assert_eq!(
            tests,
            [
                ("a".to_owned(), Some(true)),
                ("b".to_owned(), Some(false)),
                ("c".to_owned(), None)
            ]
        );
        assert_eq!(failures.len(), 1);
        assert_eq!(failures[0].0, "b");
        assert!(failures[0].1.starts_with("Error: cannot read the cookie"));
        assert!(failures[0].1.ends_with("(os error 92)"));
    }

    #[test]
    fn reads_the_guest_report() {
        let report = format!(
            "@@dp kernel 5.10.0-46-cloud-amd64\r\n@@dp module veth.ko 0\n\
             @@dp begin t1\n{LIBTEST}@@dp end t1 101 13\n@@dp done\n"
        );
        let mut run = KernelRun::new("5.10");
        run.read_guest_report(&report);
        assert_eq!(run.release, "5.10.0-46-cloud-amd64");
        assert_eq!(run.ending, Ending::Completed);
        assert_eq!(run.binaries.len(), 1);
        assert_eq!(run.binaries[0].status, Some(101));
        assert!(!run.passed());
        let table = render(&[run], &[], Duration::from_secs(75));
        assert!(table.contains("| 5.10 | 5.10.0-46-cloud-amd64 | **FAIL** (1 failed) | 1/2 |"));
        assert!(table.contains("### 5.10 / t1 / b"));
    }

    #[test]
    fn a_guest_that_stops_reporting_did_not_complete() {
        let mut run = KernelRun::new("6.1");
        run.read_guest_report("@@dp kernel 6.1.0\n@@dp begin t1\ntest a ... ok\n");
        assert_ne!(run.ending, Ending::Completed);
        assert_eq!(run.binaries[0].status, None);
    }
}
