//! Lorry's metrics, in Prometheus's text exposition format (version 0.0.4).
//!
//! Values live in atomics ([`Counter`], [`Gauge`], [`Histogram`]) that the
//! code being measured updates without taking a lock; a scrape reads them
//! into a [`Text`], which writes each family's `# HELP` and `# TYPE` once,
//! then its samples, escaped. A [`Family`] keeps one value per label set;
//! the label sets are few and fixed by the code (a model, a lane, an
//! outcome), never an account, adapter or request id.
//!
//! Names follow Prometheus's conventions: `lorry_` first, base units
//! (seconds, bytes) in the name, counters ending `_total`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// The `Content-Type` of a [`Text`] exposition.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Upper bounds, in seconds, for latencies from a millisecond to two minutes.
pub const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// A count that only goes up.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// A counter at zero.
    pub const fn new() -> Self {
        Counter(AtomicU64::new(0))
    }

    /// Add one.
    pub fn inc(&self) {
        self.add(1);
    }

    /// Add `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    /// A gauge at zero.
    pub const fn new() -> Self {
        Gauge(AtomicU64::new(0))
    }

    /// Set the value.
    pub fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    /// The value now.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Observations counted into buckets by upper bound, with their sum.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One count per bound, and one past the last (`+Inf`); not cumulative.
    buckets: Box<[AtomicU64]>,
    /// The sum's `f64` bits.
    sum: AtomicU64,
}

impl Histogram {
    /// An empty histogram over `bounds`: finite, strictly increasing.
    pub fn new(bounds: &'static [f64]) -> Self {
        assert!(
            bounds.iter().all(|b| b.is_finite()) && bounds.windows(2).all(|w| w[0] < w[1]),
            "histogram bounds must be finite and strictly increasing"
        );
        Histogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// An empty histogram over [`SECONDS`].
    pub fn seconds() -> Self {
        Self::new(SECONDS)
    }

    /// Count one observation (a NaN is ignored).
    pub fn observe(&self, value: f64) {
        if value.is_nan() {
            return;
        }
        let bucket = self.bounds.partition_point(|&bound| bound < value);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let mut current = self.sum.load(Ordering::Relaxed);
        loop {
            let next = (f64::from_bits(current) + value).to_bits();
            match self
                .sum
                .compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(seen) => current = seen,
            }
        }
    }

    /// Count a duration, in seconds.
    pub fn observe_duration(&self, duration: Duration) {
        self.observe(duration.as_secs_f64());
    }

    /// The counts now. The count is the sum of the buckets, so that the
    /// `+Inf` bucket always equals it, even while observations land.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut running = 0;
        let cumulative = self
            .buckets
            .iter()
            .map(|b| {
                running += b.load(Ordering::Relaxed);
                running
            })
            .collect();
        HistogramSnapshot {
            bounds: self.bounds,
            cumulative,
            count: running,
            sum: f64::from_bits(self.sum.load(Ordering::Relaxed)),
        }
    }
}

impl Default for Histogram {
    /// An empty histogram over [`SECONDS`].
    fn default() -> Self {
        Self::seconds()
    }
}

/// A [`Histogram`]'s counts at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// The buckets' upper bounds, `+Inf` left out.
    pub bounds: &'static [f64],
    /// Observations at or below each bound, then all of them (`+Inf`).
    pub cumulative: Vec<u64>,
    /// Observations.
    pub count: u64,
    /// Their sum.
    pub sum: f64,
}

/// A member's label names and values, in order.
pub type LabelPairs = Vec<(&'static str, String)>;

/// One metric per set of `N` label values, made on first use.
pub struct Family<M, const N: usize> {
    labels: [&'static str; N],
    members: RwLock<Vec<([String; N], Arc<M>)>>,
    make: Box<dyn Fn() -> M + Send + Sync>,
}

impl<M, const N: usize> std::fmt::Debug for Family<M, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family")
            .field("labels", &self.labels)
            .finish_non_exhaustive()
    }
}

impl<const N: usize> Family<Counter, N> {
    /// Counters labelled `labels`.
    pub fn counters(labels: [&'static str; N]) -> Self {
        Family::new(labels, Counter::new)
    }
}

impl<const N: usize> Family<Gauge, N> {
    /// Gauges labelled `labels`.
    pub fn gauges(labels: [&'static str; N]) -> Self {
        Family::new(labels, Gauge::new)
    }
}

impl<const N: usize> Family<Histogram, N> {
    /// Histograms over [`SECONDS`], labelled `labels`.
    pub fn seconds(labels: [&'static str; N]) -> Self {
        Family::new(labels, Histogram::seconds)
    }
}

impl<M, const N: usize> Family<M, N> {
    /// A family whose members `make` makes.
    pub fn new(labels: [&'static str; N], make: impl Fn() -> M + Send + Sync + 'static) -> Self {
        debug_assert!(
            labels.iter().all(|l| valid_name(l, false)),
            "bad label name in {labels:?}"
        );
        Family {
            labels,
            members: RwLock::new(Vec::new()),
            make: Box::new(make),
        }
    }

    /// The member labelled `values`, made now if it is new.
    pub fn with(&self, values: [&str; N]) -> Arc<M> {
        let matches = |(key, _): &&([String; N], Arc<M>)| key.iter().zip(values).all(|(k, v)| k == v);
        {
            let members = self.members.read().unwrap_or_else(|p| p.into_inner());
            if let Some((_, member)) = members.iter().find(matches) {
                return Arc::clone(member);
            }
        }
        let mut members = self.members.write().unwrap_or_else(|p| p.into_inner());
        if let Some((_, member)) = members.iter().find(matches) {
            return Arc::clone(member);
        }
        let member = Arc::new((self.make)());
        members.push((values.map(str::to_string), Arc::clone(&member)));
        member
    }

    /// Every member with its labels, in the order they were made.
    pub fn members(&self) -> Vec<(LabelPairs, Arc<M>)> {
        let members = self.members.read().unwrap_or_else(|p| p.into_inner());
        members
            .iter()
            .map(|(values, member)| {
                let labels = self.labels.iter().copied().zip(values.iter().cloned()).collect();
                (labels, Arc::clone(member))
            })
            .collect()
    }
}

/// An exposition being written: families one after another.
#[derive(Debug, Default)]
pub struct Text {
    out: String,
    #[cfg(debug_assertions)]
    written: std::collections::HashSet<String>,
}

/// The samples of one counter or gauge family.
pub struct Samples<'a> {
    out: &'a mut String,
    name: String,
}

/// The samples of one histogram family.
pub struct HistogramSamples<'a> {
    out: &'a mut String,
    name: String,
}

impl Text {
    /// An empty exposition.
    pub fn new() -> Self {
        Self::default()
    }

    /// Start a counter family (`name` ends `_total`).
    pub fn counter(&mut self, name: &str, help: &str) -> Samples<'_> {
        debug_assert!(name.ends_with("_total"), "counter {name} must end _total");
        self.header(name, "counter", help);
        Samples {
            out: &mut self.out,
            name: name.to_string(),
        }
    }

    /// Start a gauge family.
    pub fn gauge(&mut self, name: &str, help: &str) -> Samples<'_> {
        self.header(name, "gauge", help);
        Samples {
            out: &mut self.out,
            name: name.to_string(),
        }
    }

    /// Start a histogram family.
    pub fn histogram(&mut self, name: &str, help: &str) -> HistogramSamples<'_> {
        self.header(name, "histogram", help);
        HistogramSamples {
            out: &mut self.out,
            name: name.to_string(),
        }
    }

    /// A counter family from a [`Family`] of counters.
    pub fn counters<const N: usize>(&mut self, name: &str, help: &str, family: &Family<Counter, N>) {
        let mut samples = self.counter(name, help);
        for (labels, counter) in family.members() {
            samples.sample(&pairs(&labels), counter.get() as f64);
        }
    }

    /// A gauge family from a [`Family`] of gauges.
    pub fn gauges<const N: usize>(&mut self, name: &str, help: &str, family: &Family<Gauge, N>) {
        let mut samples = self.gauge(name, help);
        for (labels, gauge) in family.members() {
            samples.sample(&pairs(&labels), gauge.get());
        }
    }

    /// A histogram family from a [`Family`] of histograms.
    pub fn histograms<const N: usize>(&mut self, name: &str, help: &str, family: &Family<Histogram, N>) {
        let mut samples = self.histogram(name, help);
        for (labels, histogram) in family.members() {
            samples.sample(&pairs(&labels), &histogram.snapshot());
        }
    }

    /// The exposition.
    pub fn finish(self) -> String {
        self.out
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        debug_assert!(valid_name(name, true), "bad metric name {name}");
        #[cfg(debug_assertions)]
        assert!(
            self.written.insert(name.to_string()),
            "metric family {name} written twice"
        );
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }
}

impl Samples<'_> {
    /// One sample.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: f64) -> &mut Self {
        write_sample(self.out, &self.name, labels, None, value);
        self
    }
}

impl HistogramSamples<'_> {
    /// One histogram: its buckets, sum and count.
    pub fn sample(&mut self, labels: &[(&str, &str)], snapshot: &HistogramSnapshot) -> &mut Self {
        let bucket = format!("{}_bucket", self.name);
        for (i, &count) in snapshot.cumulative.iter().enumerate() {
            let le = snapshot
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |&b| number(b));
            write_sample(self.out, &bucket, labels, Some(&le), count as f64);
        }
        write_sample(self.out, &format!("{}_sum", self.name), labels, None, snapshot.sum);
        write_sample(
            self.out,
            &format!("{}_count", self.name),
            labels,
            None,
            snapshot.count as f64,
        );
        self
    }
}

fn pairs<'a>(labels: &'a [(&'static str, String)]) -> Vec<(&'a str, &'a str)> {
    labels.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn write_sample(out: &mut String, name: &str, labels: &[(&str, &str)], le: Option<&str>, value: f64) {
    out.push_str(name);
    let le = le.map(|le| ("le", le));
    let mut all = labels.iter().copied().chain(le).peekable();
    if all.peek().is_some() {
        out.push('{');
        for (i, (key, value)) in all.enumerate() {
            debug_assert!(valid_name(key, false), "bad label name {key}");
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{key}=\"{}\"", escape_label(value));
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(&number(value));
    out.push('\n');
}

/// A sample value as Prometheus writes one: integers without a fraction,
/// `+Inf`, `-Inf`, `NaN`.
fn number(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{}", value as i64)
    } else {
        format!("{value}")
    }
}

fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A metric name (`colons` allowed) or label name.
fn valid_name(name: &str, colons: bool) -> bool {
    let ok = |c: char, first: bool| {
        c.is_ascii_alphabetic() || c == '_' || (colons && c == ':') || (!first && c.is_ascii_digit())
    };
    let mut chars = name.chars();
    chars.next().is_some_and(|c| ok(c, true)) && chars.all(|c| ok(c, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prometheus's own parser (and naming rules) passes `text`.
    fn promtool_passes(text: &str) {
        use std::io::Write as _;
        let promtool = std::env::var("LORRY_TEST_PROMTOOL").expect(
            "LORRY_TEST_PROMTOOL names Prometheus's promtool; run the suite with scripts/test, which fetches it",
        );
        let mut check = std::process::Command::new(promtool)
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("running promtool");
        check.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let out = check.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool refuses:\n{}{}\n{text}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn counters_gauges_and_histograms_are_written_as_prometheus_reads_them() {
        let requests = Family::counters(["lane", "outcome"]);
        requests.with(["batch", "succeeded"]).add(3);
        requests.with(["batch", "succeeded"]).inc();
        requests.with(["real_time", "failed"]).inc();
        let steps = Histogram::new(&[0.01, 0.1, 1.0]);
        for v in [0.005, 0.05, 0.05, 0.5, 5.0] {
            steps.observe(v);
        }
        let mut text = Text::new();
        text.counters("lorry_requests_total", "Requests ended.", &requests);
        text.gauge("lorry_kv_blocks", "KV blocks.")
            .sample(&[("state", "free")], 12.0)
            .sample(&[("state", "used")], 4.0);
        text.histogram("lorry_step_duration_seconds", "Step time.")
            .sample(&[("route", "/v1/{id}")], &steps.snapshot());
        let text = text.finish();
        promtool_passes(&text);
        assert_eq!(
            text,
            "# HELP lorry_requests_total Requests ended.\n\
             # TYPE lorry_requests_total counter\n\
             lorry_requests_total{lane=\"batch\",outcome=\"succeeded\"} 4\n\
             lorry_requests_total{lane=\"real_time\",outcome=\"failed\"} 1\n\
             # HELP lorry_kv_blocks KV blocks.\n\
             # TYPE lorry_kv_blocks gauge\n\
             lorry_kv_blocks{state=\"free\"} 12\n\
             lorry_kv_blocks{state=\"used\"} 4\n\
             # HELP lorry_step_duration_seconds Step time.\n\
             # TYPE lorry_step_duration_seconds histogram\n\
             lorry_step_duration_seconds_bucket{route=\"/v1/{id}\",le=\"0.01\"} 1\n\
             lorry_step_duration_seconds_bucket{route=\"/v1/{id}\",le=\"0.1\"} 3\n\
             lorry_step_duration_seconds_bucket{route=\"/v1/{id}\",le=\"1\"} 4\n\
             lorry_step_duration_seconds_bucket{route=\"/v1/{id}\",le=\"+Inf\"} 5\n\
             lorry_step_duration_seconds_sum{route=\"/v1/{id}\"} 5.605\n\
             lorry_step_duration_seconds_count{route=\"/v1/{id}\"} 5\n"
        );
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let mut text = Text::new();
        text.gauge("lorry_odd", "A \\ help\nline.")
            .sample(&[("model", "a\"b\\c\nd")], 1.5);
        let text = text.finish();
        assert_eq!(
            text,
            "# HELP lorry_odd A \\\\ help\\nline.\n# TYPE lorry_odd gauge\nlorry_odd{model=\"a\\\"b\\\\c\\nd\"} 1.5\n"
        );
    }

    #[test]
    fn values_are_written_as_prometheus_writes_them() {
        assert_eq!(number(3.0), "3");
        assert_eq!(number(0.25), "0.25");
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(f64::NEG_INFINITY), "-Inf");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(1e20), "100000000000000000000");
    }

    #[test]
    fn a_family_makes_each_member_once_and_keeps_it() {
        let family = Family::counters(["model"]);
        let a = family.with(["a"]);
        a.add(2);
        assert_eq!(family.with(["a"]).get(), 2);
        family.with(["b"]).inc();
        let members = family.members();
        assert_eq!(members.len(), 2);
        assert_eq!(members[0].0, vec![("model", "a".to_string())]);
    }

    #[test]
    fn concurrent_observations_are_all_counted() {
        let histogram = Arc::new(Histogram::seconds());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let h = Arc::clone(&histogram);
                std::thread::spawn(move || {
                    for i in 0..10_000 {
                        h.observe(f64::from(i % 7) * 0.01);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let snapshot = histogram.snapshot();
        assert_eq!(snapshot.count, 40_000);
        assert_eq!(*snapshot.cumulative.last().unwrap(), 40_000);
        let exact: f64 = (0..10_000).map(|i| f64::from(i % 7) * 0.01).sum::<f64>() * 4.0;
        assert!((snapshot.sum - exact).abs() < 1e-6, "{} vs {exact}", snapshot.sum);
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(valid_name("lorry_a:b_total", true));
        assert!(!valid_name("lorry_a:b", false));
        assert!(!valid_name("1abc", true));
        assert!(!valid_name("", true));
        assert!(!valid_name("a-b", true));
    }
}
