//! Which access records of connections that ended well are written
//! (`--access-log-sample`): a fraction of them, drawn per connection.
//! Records of connections that failed, were refused or were closed by the
//! agent are always written, so an operator who samples the common case
//! still sees every error (istio/istio#43376 asks for both).

use std::sync::atomic::{AtomicU32, Ordering};

/// Parts per million of the records of clean closes that are written.
const MILLION: u32 = 1_000_000;

/// The fraction of clean-close records written, set once at start-up and
/// read by every connection as it closes.
#[derive(Debug)]
pub struct AccessSample(AtomicU32);

impl Default for AccessSample {
    fn default() -> Self {
        Self(AtomicU32::new(MILLION))
    }
}

impl AccessSample {
    /// Writes `rate` (0 to 1; out of range or not a number: clamped, 0
    /// for NaN) of the clean-close records from now on.
    pub fn set(&self, rate: f64) {
        let rate = if rate.is_nan() {
            0.0
        } else {
            rate.clamp(0.0, 1.0)
        };
        self.0.store(
            (rate * f64::from(MILLION)).round() as u32,
            Ordering::Relaxed,
        );
    }

    /// Whether this clean close's record is written.
    pub fn keep(&self) -> bool {
        match self.0.load(Ordering::Relaxed) {
            0 => false,
            MILLION.. => true,
            ppm => dataplane_model::state::random_index(MILLION as usize) < ppm as usize,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_none_and_about_the_fraction() {
        let sample = AccessSample::default();
        assert!((0..1000).all(|_| sample.keep()));
        sample.set(0.0);
        assert!((0..1000).all(|_| !sample.keep()));
        sample.set(f64::NAN);
        assert!(!sample.keep());
        sample.set(7.0);
        assert!(sample.keep());
        // 10,000 draws at 1/4: 2,500 expected, the standard deviation
        // about 43; 400 either side is more than 9 of them.
        sample.set(0.25);
        let kept = (0..10_000).filter(|_| sample.keep()).count();
        assert!((2_100..=2_900).contains(&kept), "{kept}");
    }
}
