//! The quantity parser under a million generated inputs, and a regression corpus.
//!
//! The toolchain here is stable-only, so coverage-guided fuzzing (cargo-fuzz needs nightly) is replaced by
//! property tests with generated inputs; every input that ever broke an expectation goes into
//! tests/corpus/quantities.txt.

use gpubudget_common::quantity::{format_exact, parse_bytes};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[test]
fn regression_corpus() {
    let corpus = include_str!("corpus/quantities.txt");
    let mut checked = 0;
    for line in corpus.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (input, want) = line.rsplit_once('\t').unwrap_or_else(|| panic!("bad corpus line {line:?}"));
        let got = parse_bytes(input);
        match want {
            "err" => assert!(got.is_err(), "{input:?} should be rejected, got {got:?}"),
            n => assert_eq!(got, Ok(n.parse().expect("number")), "{input:?}"),
        }
        checked += 1;
    }
    assert!(checked > 40);
}

/// A million inputs shaped like quantities (digits, dots, signs, suffix letters, exponents) and a share of
/// arbitrary text: the parser never panics, and whatever it accepts prints back exactly.
#[test]
fn a_million_generated_inputs() {
    let mut runner = TestRunner::new(Config { cases: 1_000_000, failure_persistence: None, ..Config::default() });
    let shaped =
        "[+-]?[0-9]{0,22}(\\.[0-9]{0,22})?(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]{0,4}|[a-zA-Z ]{0,2})?";
    let strategy = prop_oneof![8 => shaped, 1 => "\\PC{0,16}", 1 => proptest::collection::vec(any::<u8>(), 0..16)
        .prop_map(|b| String::from_utf8_lossy(&b).into_owned())];
    runner
        .run(&strategy, |input| {
            if let Ok(bytes) = parse_bytes(&input) {
                prop_assert_eq!(parse_bytes(&format_exact(bytes)), Ok(bytes));
                prop_assert!(bytes <= i64::MAX as u64);
            }
            Ok(())
        })
        .expect("no failure");
}
