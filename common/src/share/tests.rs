use super::*;
use proptest::prelude::*;

const GIB: u64 = 1 << 30;
/// An H100's memory as NVML reports it (81559 MiB).
const H100: u64 = 81_559 * MIB;

fn pod(yaml: &str) -> Pod {
    serde_yaml::from_str(yaml).expect("pod fixture")
}

fn kai(annotations: &str) -> Pod {
    pod(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: a, annotations: {{{annotations}}}}}\n\
         spec: {{schedulerName: kai-scheduler, containers: [{{name: c, image: i}}]}}\n"
    ))
}

fn hami(resources: &str) -> Pod {
    pod(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: a}}\n\
         spec: {{containers: [{{name: c, image: i, resources: {{limits: {{{resources}}}}}}}]}}\n"
    ))
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn share(d: Declaration) -> Vec<Term> {
    match d {
        Declaration::Share(t) => t,
        other => panic!("expected a share, got {other:?}"),
    }
}

fn invalid(d: Declaration) -> String {
    match d.fault(Sources::ALL) {
        Some(why) => why.to_string(),
        None => panic!("expected invalid, got {d:?}"),
    }
}

#[test]
fn a_kai_fraction_resolves_against_the_gpu_and_says_so() {
    let terms = share(declared(&kai("gpu-fraction: '0.5'"), None, Sources::ALL));
    let r = resolve(&terms, &[H100]).expect("resolves");
    assert_eq!(r.bytes, H100 / 2);
    assert_eq!(r.text, "KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi");
    assert_eq!(resolve(&terms, &[]), Err(ShareFault::NotKnownYet));
}

/// What each fault says in messages (users read these words: they are kept).
#[test]
fn share_faults_say_why_in_words() {
    assert_eq!(ShareFault::NotKnownYet.to_string(), "the node's GPU memory is not known yet");
    assert_eq!(ShareFault::ReplicasNotKnown.to_string(), "the node's MPS replicas are not known");
    let invalid = ShareFault::Invalid { source: ShareSource::KaiFraction, why: "gpu-fraction: \"lots\"".into() };
    assert_eq!(invalid.to_string(), "gpu-fraction: \"lots\"");
    assert!(invalid.is_pods() && !ShareFault::NotKnownYet.is_pods() && !ShareFault::ReplicasNotKnown.is_pods());
    let replicas = Term { source: ShareSource::MpsReplicas, amount: Amount::NodeReplicas, devices: 1 };
    assert_eq!(resolve(&[replicas], &[H100]), Err(ShareFault::ReplicasNotKnown));
}

#[test]
fn a_fraction_over_several_devices_counts_each_and_the_smallest_gpu() {
    let terms = share(declared(&kai("gpu-fraction: '0.25', gpu-fraction-num-devices: '2'"), None, Sources::ALL));
    let r = resolve(&terms, &[H100, 40 * GIB]).expect("resolves");
    assert_eq!(r.bytes, 20 * GIB, "0.25 of the smaller 40Gi GPU, twice");
    assert_eq!(r.text, "KAI gpu-fraction 0.25 × 2 GPUs of 40Gi = 20Gi");
}

#[test]
fn absolute_shares_need_no_gpu() {
    let r = resolve(&share(declared(&kai("gpu-memory: '20000'"), None, Sources::ALL)), &[]).expect("resolves");
    assert_eq!((r.bytes, r.text.as_str()), (20_000 * MIB, "KAI gpu-memory 20000 MiB = 19.5Gi"));
    let r = resolve(&share(declared(&hami("nvidia.com/gpu: 2, nvidia.com/gpumem: 10240"), None, Sources::ALL)), &[])
        .expect("resolves");
    assert_eq!((r.bytes, r.text.as_str()), (20 * GIB, "HAMi gpumem 10240 MiB × 2 GPUs = 20Gi"));
}

#[test]
fn hami_percentage_and_every_container_add_up() {
    let p = pod(r"
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: a}
spec:
  containers:
    - {name: a, image: i, resources: {limits: {nvidia.com/gpu: 1, nvidia.com/gpumem-percentage: 25}}}
    - {name: b, image: i, resources: {requests: {nvidia.com/gpumem: 1024}}}
    - {name: c, image: i}
");
    let r = resolve(&share(declared(&p, None, Sources::ALL)), &[80 * GIB]).expect("resolves");
    assert_eq!(r.bytes, 20 * GIB + GIB);
    assert_eq!(r.text, "HAMi gpumem-percentage 25 + HAMi gpumem 1024 MiB of 80Gi = 21Gi");
}

#[test]
fn mps_replicas_read_the_nodes_labels_and_time_slicing_declares_nothing() {
    let p = hami("nvidia.com/gpu: 1");
    let mps = labels(&[(SHARING_STRATEGY, "mps"), (REPLICAS, "4")]);
    let r = resolve(&share(declared(&p, Some(&mps), Sources::ALL)), &[80 * GIB]).expect("resolves");
    assert_eq!((r.bytes, r.text.as_str()), (20 * GIB, "MPS replica of 4 per GPU of 80Gi = 20Gi"));
    let slicing = labels(&[(SHARING_STRATEGY, "time-slicing"), (REPLICAS, "4")]);
    assert_eq!(declared(&p, Some(&slicing), Sources::ALL), Declaration::None);
    assert_eq!(declared(&p, None, Sources::ALL), Declaration::None, "the node's labels unknown: not read");
    let no_replicas = labels(&[(SHARING_STRATEGY, "mps")]);
    assert!(invalid(declared(&p, Some(&no_replicas), Sources::ALL)).contains("no nvidia.com/gpu.replicas label"));
}

/// The agent keeps what the pod declares and reads its node's labels when it builds its table: a node relabelled
/// by GPU feature discovery changes the pods' shares without their specs (dropped from its cache) being read again.
#[test]
fn gpu_replicas_wait_for_the_nodes_labels() {
    let mps = labels(&[(SHARING_STRATEGY, "mps"), (REPLICAS, "4")]);
    let kept = declared_by_pod(&hami("nvidia.com/gpu: 2"), Sources::ALL);
    let slim = Declaration::decode(&kept.encode()).expect("kept as text");
    assert_eq!((kept.encode().as_str(), &slim), ("share:mr/n0/2", &kept));
    assert_eq!(kept.clone().on_node(None), Declaration::None, "no labels: no share");
    let on_mps = kept.on_node(Some(&mps));
    let r = resolve(&share(on_mps), &[80 * GIB]).expect("resolves");
    assert_eq!((r.bytes, r.text.as_str()), (40 * GIB, "MPS replicas × 2 of 4 per GPU of 80Gi = 40Gi"));
    // A count of 0 declares nothing anywhere; one that is no whole number only matters on an MPS node.
    assert_eq!(declared(&hami("nvidia.com/gpu: 0"), Some(&mps), Sources::ALL), Declaration::None);
    let odd = hami("nvidia.com/gpu: lots");
    assert_eq!(declared(&odd, None, Sources::ALL), Declaration::None);
    assert!(invalid(declared(&odd, Some(&mps), Sources::ALL)).contains("no whole number"));
    assert!(invalid(declared(&hami("nvidia.com/gpu: 65"), Some(&mps), Sources::ALL)).contains("(read 65)"));
}

#[test]
fn only_the_sources_a_budget_names_are_read() {
    let p = kai("gpu-fraction: '0.5'");
    assert_eq!(declared(&p, None, Sources::of(&[ShareSource::HamiMemory])), Declaration::None);
    assert!(matches!(declared(&p, None, Sources::of(&[ShareSource::KaiFraction])), Declaration::Share(_)));
    assert_eq!(Sources::of(&[]), Sources::ALL);
}

#[test]
fn hostile_values_are_invalid_with_a_bounded_reason() {
    for v in ["abc", "1.5", "-0.5", "0", "0.0", "NaN", "1e400", "", ".", "0.1234567", " 0.5", "0,5", "+0.5"] {
        let why = invalid(declared(&kai(&format!("gpu-fraction: '{v}'")), None, Sources::ALL));
        assert!(why.starts_with("gpu-fraction: "), "{v}: {why}");
    }
    let long = "9".repeat(10_000);
    let why = invalid(declared(&kai(&format!("gpu-fraction: '{long}'")), None, Sources::ALL));
    assert!(why.len() < 200 && why.contains("(10000 characters)"), "{why}");
    for v in ["-1", "99999999999999999999", "12Gi", "0"] {
        assert!(invalid(declared(&kai(&format!("gpu-memory: '{v}'")), None, Sources::ALL)).starts_with("gpu-memory"));
    }
    for v in ["0", "1000000", "2.5"] {
        let p = kai(&format!("gpu-fraction: '0.5', gpu-fraction-num-devices: '{v}'"));
        assert!(invalid(declared(&p, None, Sources::ALL)).starts_with("gpu-fraction-num-devices"), "{v}");
    }
    assert!(
        invalid(declared(&hami("nvidia.com/gpumem-percentage: 150"), None, Sources::ALL)).contains("from 1 to 100")
    );
    assert!(
        invalid(declared(&hami("nvidia.com/gpumem: 2000000000"), None, Sources::ALL)).contains("more than any GPU")
    );
}

#[test]
fn kai_annotations_count_only_on_pods_kai_placed() {
    let mut forged = kai("gpu-fraction: '1'");
    forged.spec.as_mut().expect("spec").scheduler_name = Some("default-scheduler".into());
    assert_eq!(declared(&forged, None, Sources::ALL), Declaration::None, "anyone may write an annotation");
}

#[test]
fn fractions_parse_exactly() {
    for (v, pm) in [("1", 1_000_000), ("0.5", 500_000), (".25", 250_000), ("0.000001", 1), ("1.000000", 1_000_000)] {
        assert_eq!(fraction(v), Ok(pm), "{v}");
    }
    assert_eq!(decimal(333_333), "0.333333");
    assert_eq!(decimal(1_000_000), "1");
}

#[test]
fn a_declaration_survives_the_agents_cache() {
    for d in [
        Declaration::None,
        Declaration::invalid(ShareSource::KaiFraction, "gpu-fraction: \"abc\" is not a decimal"),
        Declaration::Invalid {
            faults: vec![(ShareSource::HamiMemory, "a: b".into()), (ShareSource::MpsReplicas, "c\\nd".into())],
            terms: vec![Term { source: ShareSource::KaiMemory, amount: Amount::Mib(5), devices: 2 }],
        },
        declared(&kai("gpu-fraction: '0.25', gpu-fraction-num-devices: '2'"), None, Sources::ALL),
        declared(&hami("nvidia.com/gpu: 2, nvidia.com/gpumem: 10240"), None, Sources::ALL),
        declared(
            &hami("nvidia.com/gpu: 1"),
            Some(&labels(&[(SHARING_STRATEGY, "mps"), (REPLICAS, "4")])),
            Sources::ALL,
        ),
    ] {
        assert_eq!(Declaration::decode(&d.encode()), Ok(d.clone()), "{d:?}");
    }
    let term = |t: &str| Err(DecodeError::Term(t.into()));
    for (bad, why) in [
        ("", Err(DecodeError::Form(String::new()))),
        ("shares:kf/m1/1", Err(DecodeError::Form("shares:kf/m1/1".into()))),
        ("share:", Err(DecodeError::Source(String::new()))),
        ("share:xx/m1/1", Err(DecodeError::Source("xx".into()))),
        ("share:kf/q1/1", term("kf/q1/1")),
        ("share:kf/m1", term("kf/m1")),
        ("share:mr/r0/1", term("mr/r0/1")),
        ("share:kf/m1/1/2", term("kf/m1/1/2")),
        ("share:kf/m1/1,hm/mx/1", term("hm/mx/1")),
        ("invalid:", Err(DecodeError::Fault(String::new()))),
        ("invalid:share:kf/m1/1", Err(DecodeError::NoFault)),
        ("invalid:zz:why", Err(DecodeError::Source("zz".into()))),
    ] {
        assert_eq!(Declaration::decode(bad), why, "{bad}");
    }
}

/// The agent's cache holds declarations in this form ([`Declaration::encode`]): pinned, byte for byte.
#[test]
fn a_declaration_is_encoded_as_it_always_was() {
    let t = |source, amount, devices| Term { source, amount, devices };
    for (d, text) in [
        (Declaration::None, "none"),
        (Declaration::Share(vec![t(ShareSource::KaiFraction, Amount::PerMillion(250_000), 2)]), "share:kf/p250000/2"),
        (
            Declaration::Share(vec![
                t(ShareSource::HamiMemory, Amount::Mib(10_240), 2),
                t(ShareSource::HamiPercentage, Amount::PerMillion(500_000), 1),
                t(ShareSource::MpsReplicas, Amount::Replica(4), 1),
                t(ShareSource::MpsReplicas, Amount::NodeReplicas, 3),
                t(ShareSource::KaiMemory, Amount::Mib(20_000), 1),
            ]),
            "share:hm/m10240/2,hp/p500000/1,mr/r4/1,mr/n0/3,km/m20000/1",
        ),
        (
            Declaration::invalid(ShareSource::KaiFraction, "gpu-fraction: \"abc\" is not a decimal"),
            "invalid:kf:gpu-fraction: \"abc\" is not a decimal",
        ),
        (
            Declaration::Invalid {
                faults: vec![(ShareSource::HamiMemory, "a: b".into()), (ShareSource::MpsReplicas, "c\\nd".into())],
                terms: vec![t(ShareSource::KaiMemory, Amount::Mib(5), 2)],
            },
            "invalid:hm:a: b\nmr:c\\nd\nshare:km/m5/2",
        ),
    ] {
        assert_eq!(d.encode(), text, "{d:?}");
        assert_eq!(Declaration::decode(text), Ok(d));
    }
    // A line break in a reason (never written: every value is quoted) is kept as a space, not a new line.
    let broken = Declaration::invalid(ShareSource::HamiMemory, "a\nb\rc");
    assert_eq!(broken.encode(), "invalid:hm:a b c");
}

#[test]
fn a_budget_reads_only_its_sources_and_an_invalid_declaration_is_never_a_share() {
    let d = share(declared(&kai("gpu-fraction: '0.5'"), None, Sources::ALL));
    let d = Declaration::Share(d);
    assert_eq!(d.under(Sources::of(&[ShareSource::HamiMemory]), &[H100]), None);
    assert_eq!(d.under(Sources::ALL, &[H100]).unwrap().unwrap().bytes, H100 / 2);
    let x = Declaration::invalid(ShareSource::KaiFraction, "x");
    assert_eq!(
        x.under(Sources::ALL, &[H100]),
        Some(Err(ShareFault::Invalid { source: ShareSource::KaiFraction, why: "x".into() }))
    );
    assert_eq!(d.under(Sources::ALL, &[]), Some(Err(ShareFault::NotKnownYet)));
}

fn any_term() -> impl Strategy<Value = Term> {
    let amount = prop_oneof![
        any::<u32>().prop_map(Amount::PerMillion),
        any::<u64>().prop_map(Amount::Mib),
        (1u32..).prop_map(Amount::Replica),
        Just(Amount::NodeReplicas),
    ];
    (proptest::sample::select(ShareSource::ALL.to_vec()), amount, any::<u32>())
        .prop_map(|(source, amount, devices)| Term { source, amount, devices })
}

/// Any declaration [`declared_by_pod`] and [`Declaration::on_node`] can make: a share has a term; an invalid one
/// a fault, at most one per source, whose reason has no line break.
fn any_declaration() -> impl Strategy<Value = Declaration> {
    let terms = proptest::collection::vec(any_term(), 0..5);
    let faults =
        proptest::collection::btree_map(proptest::sample::select(ShareSource::ALL.to_vec()), "[^\r\n]{0,40}", 1..4);
    prop_oneof![
        Just(Declaration::None),
        proptest::collection::vec(any_term(), 1..5).prop_map(Declaration::Share),
        (faults, terms)
            .prop_map(|(faults, terms)| Declaration::Invalid { faults: faults.into_iter().collect(), terms }),
    ]
}

proptest! {
    /// Whatever the agent keeps of a declaration, it reads back the same ([`Declaration::encode`], `decode`).
    #[test]
    fn every_declaration_survives_the_agents_cache(d in any_declaration()) {
        prop_assert_eq!(Declaration::decode(&d.encode()), Ok(d));
    }

    /// A fraction's bytes never exceed its share of the smallest GPU on every device it names, grow with the
    /// fraction, and the text names the result.
    #[test]
    fn fractions_are_monotonic_and_bounded(a in 1u32..=1_000_000, b in 1u32..=1_000_000, devices in 1u32..=8,
                                           totals in proptest::collection::vec(1u64..=200 * GIB, 1..8)) {
        let t = |pm| [Term { source: ShareSource::KaiFraction, amount: Amount::PerMillion(pm), devices }];
        let (ra, rb) = (resolve(&t(a), &totals).unwrap(), resolve(&t(b), &totals).unwrap());
        let smallest = *totals.iter().min().unwrap();
        prop_assert!(ra.bytes <= smallest * u64::from(devices));
        if a <= b {
            prop_assert!(ra.bytes <= rb.bytes);
        }
        prop_assert!(ra.text.ends_with(&HumanBytes(ra.bytes).to_string()));
    }

    /// #51: HAMi's MiB read the same in the form the pod's author wrote and in the one the API server stores
    /// (`20000` → `20k`, `3000000` → `3M`), and whatever is written there is read safely and boundedly.
    #[test]
    fn hami_mib_read_the_same_in_every_stored_form(n in 1u64..=1_000_000, junk in "\\PC{0,40}") {
        let mut stored = n;
        let mut suffix = "";
        for s in ["k", "M"] {
            if stored.is_multiple_of(1000) {
                stored /= 1000;
                suffix = s;
            }
        }
        for form in [n.to_string(), format!("{stored}{suffix}"), format!("{n}e0")] {
            let d = declared(&hami(&format!("nvidia.com/gpumem: '{form}'")), None, Sources::ALL);
            prop_assert_eq!(resolve(&share(d), &[]).expect("resolves").bytes, n * MIB, "{}", form);
        }
        let mut p = hami("nvidia.com/gpumem: 1");
        let limits = p.spec.as_mut().unwrap().containers[0].resources.as_mut().unwrap().limits.as_mut().unwrap();
        limits.insert(HAMI_MEMORY.into(), k8s_openapi::apimachinery::pkg::api::resource::Quantity(junk.clone()));
        match declared(&p, None, Sources::ALL) {
            Declaration::Share(t) => prop_assert!(crate::quantity::parse_whole(&junk).is_ok() && t.len() == 1),
            d => prop_assert!(d.fault(Sources::ALL).is_some_and(|w| w.to_string().len() < 600)),
        }
    }

    /// Whatever a tenant writes in the annotations, reading it never panics, and an invalid reason stays short.
    #[test]
    fn any_annotation_is_read_safely(f in ".{0,64}", m in ".{0,64}", n in ".{0,64}") {
        let mut p = kai("");
        let a = p.metadata.annotations.get_or_insert_default();
        a.insert(KAI_FRACTION.into(), f);
        a.insert(KAI_MEMORY.into(), m);
        a.insert(KAI_NUM_DEVICES.into(), n);
        match declared(&p, None, Sources::ALL) {
            Declaration::Invalid { faults, .. } => prop_assert!(faults.iter().all(|(_, why)| why.len() < 400)),
            Declaration::Share(terms) => { let _ = resolve(&terms, &[H100]); }
            Declaration::None => prop_assert!(false, "both annotations are set"),
        }
    }
}

#[test]
fn a_held_share_round_trips_and_its_note_is_bounded() {
    let held = HeldShare::new(20 << 30, vec![ShareSource::KaiFraction], "KAI gpu-fraction 0.25 of 80Gi = 20Gi".into());
    assert!(held.resolved());
    assert_eq!(HeldShare::from_annotation(&held.to_annotation()), Some(held));
    // Many HAMi containers make a long note: cut on a character boundary, marked.
    let long = "HAMi gpumem 10240 MiB × 2 GPUs + ".repeat(40);
    let cut = HeldShare::new(1, vec![], long.clone());
    assert!(cut.note.len() <= HeldShare::NOTE_MAX && cut.note.ends_with('…') && long.starts_with(&cut.note[..200]));
    assert!(!cut.resolved(), "no source: unresolved");
    assert_eq!(HeldShare::from_annotation(&cut.to_annotation()).map(|h| h.note), Some(cut.note));
    // Anything else is no record: garbage, or longer than the agent writes.
    assert_eq!(HeldShare::from_annotation("KAI 0.5"), None);
    assert_eq!(HeldShare::from_annotation(&format!("{{\"limitBytes\":1,\"note\":\"{}\"}}", "x".repeat(1800))), None);
    // The longest the agent writes, a kept share's included, is read back.
    let quotes = "\"".repeat(400);
    let longest = HeldShare::new(1, vec![ShareSource::KaiMemory], quotes.clone()).kept_over(quotes);
    assert_eq!(HeldShare::from_annotation(&longest.to_annotation()), Some(longest));
}

/// #51: the API server stores `nvidia.com/gpumem: 20000` as `20k` (every multiple of 1 000 is shortened): each
/// stored form reads as the same MiB, and a value that is no whole number of MiB (or GPUs) is refused.
#[test]
fn hami_values_read_in_every_form_the_api_server_stores() {
    for v in ["20000", "20k", "2e4", "20000000m", "2E+4"] {
        let r = resolve(&share(declared(&hami(&format!("nvidia.com/gpumem: '{v}'")), None, Sources::ALL)), &[])
            .expect("resolves");
        assert_eq!((r.bytes, r.text.as_str()), (20_000 * MIB, "HAMi gpumem 20000 MiB = 19.5Gi"), "{v}");
    }
    let r = resolve(&share(declared(&hami("nvidia.com/gpumem: 3k, nvidia.com/gpu: 2"), None, Sources::ALL)), &[])
        .expect("resolves");
    assert_eq!(r.bytes, 2 * 3_000 * MIB);
    let p = hami("nvidia.com/gpumem-percentage: '5e1', nvidia.com/gpu: '1e0'");
    assert_eq!(resolve(&share(declared(&p, None, Sources::ALL)), &[80 * GIB]).expect("resolves").bytes, 40 * GIB);
    for v in ["1500m", "0.5", "20k5", "1e400", "-20k", &"1".repeat(40)] {
        let why = invalid(declared(&hami(&format!("nvidia.com/gpumem: '{v}'")), None, Sources::ALL));
        assert!(why.starts_with("container \"c\": nvidia.com/gpumem: ") && why.len() < 200, "{v}: {why}");
    }
    let why = invalid(declared(&hami("nvidia.com/gpumem: 20k, nvidia.com/gpu: 1500m"), None, Sources::ALL));
    assert!(why.contains("nvidia.com/gpu: \"1500m\" is not a whole number"), "{why}");
    // MPS replicas asked for in any stored form count the same.
    let mps = labels(&[(SHARING_STRATEGY, "mps"), (REPLICAS, "4")]);
    let r = resolve(&share(declared(&hami("nvidia.com/gpu: '2e0'"), Some(&mps), Sources::ALL)), &[80 * GIB]);
    assert_eq!(r.expect("resolves").bytes, 40 * GIB);
}

/// #51: a malformed value from a source a budget does not read spoils nothing under that budget: it still gets
/// the share of the sources it reads; a budget that reads the faulty source holds the pod unresolved.
#[test]
fn a_fault_in_an_unread_source_does_not_void_the_share() {
    let p = pod(r"
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: a, annotations: {gpu-fraction: lots}}
spec:
  schedulerName: kai-scheduler
  containers:
    - {name: c, image: i, resources: {limits: {nvidia.com/gpumem: 20k}}}
");
    let d = declared(&p, None, Sources::ALL);
    let hami_only = Sources::of(&[ShareSource::HamiMemory]);
    assert_eq!(d.fault(hami_only), None);
    assert_eq!(d.under(hami_only, &[]).expect("declared").expect("resolves").bytes, 20_000 * MIB);
    let fault = d.fault(Sources::ALL).expect("KAI's value is faulty");
    assert!(
        matches!(&fault, ShareFault::Invalid { source: ShareSource::KaiFraction, why } if why.starts_with("gpu-fraction: \"lots\"")),
        "{fault:?}"
    );
    assert_eq!(d.under(Sources::ALL, &[H100]), Some(Err(fault)));
    assert_eq!(Declaration::decode(&d.encode()), Ok(d.clone()), "kept through the agent's cache");
    // A fault in the node's MPS labels spoils the replicas only.
    let q = hami("nvidia.com/gpu: 1, nvidia.com/gpumem: 1024");
    let bad = labels(&[(SHARING_STRATEGY, "mps"), (REPLICAS, "many")]);
    let on = declared_by_pod(&q, Sources::ALL).on_node(Some(&bad));
    assert_eq!(on.under(hami_only, &[]).expect("declared").expect("resolves").bytes, GIB);
    assert!(matches!(on.fault(Sources::of(&[ShareSource::MpsReplicas])),
                 Some(ShareFault::Invalid { source: ShareSource::MpsReplicas, why }) if why.contains("nvidia.com/gpu.replicas")));
}
