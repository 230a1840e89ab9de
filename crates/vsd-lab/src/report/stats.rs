//! Summaries over a configuration's repetitions.

/// The median of some repetitions and the range they span.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; `None` when there are none.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Spread> {
        let mut values: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
        values.sort_by(f64::total_cmp);
        let (&min, &max) = (values.first()?, values.last()?);
        let mid = values.len() / 2;
        let median = if values.len().is_multiple_of(2) { (values[mid - 1] + values[mid]) / 2.0 } else { values[mid] };
        Some(Spread { median, min, max })
    }
}

/// The median of `values`; `None` when there are none.
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    Spread::of(values).map(|spread| spread.median)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_take_the_middle_and_the_ends() {
        assert_eq!(Spread::of([3.0, 1.0, 2.0]), Some(Spread { median: 2.0, min: 1.0, max: 3.0 }));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(Spread::of([f64::NAN]), None);
        assert_eq!(median([]), None);
    }
}
