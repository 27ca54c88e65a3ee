//! Stand-in tests: `DriverLimits` against two stand-in libraries built from `tests/standin/nvml_standin.c`,
//! **not the R615 driver** (none is available here; the H100 runs driver 580, which lacks the calls). One
//! stand-in is R615-shaped (it has `nvmlDeviceGetMemoryLimits_v1` and answers from a table each test writes),
//! the other R580-shaped (no limit call; driver "580.159.04"). They check what can be checked without the
//! driver: the symbol's detection, the struct's layout as C sees it, the return codes' meaning, and that every
//! `nvmlInit_v2` is matched by an `nvmlShutdown`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use gpubudget_nvml_limits::{DriverLimits, Limits, ReadError, Reading, SetError, Unavailable};

const GPU: &str = "GPU-standin-0";
const CGROUP: &str = "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5a1e3c9d_7b2f_4e8a_9c61_0d3f2b7a8e41.slice/cri-containerd-a3f1c2d4e5b6.scope";

/// Builds the two stand-ins once per test run (with `$CC`, else `cc`), into the test's scratch directory.
fn built() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/standin/nvml_standin.c");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvml-standin");
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
        let build = |name: &str, defines: &[&str]| {
            let out = dir.join(name);
            let status = Command::new(&cc)
                .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-std=c11"])
                .args(defines)
                .arg("-o")
                .arg(&out)
                .arg(&source)
                .status()
                .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
            assert!(status.success(), "building the stand-in {name} failed: {status}");
            out
        };
        (build("r615.so", &["-DSTANDIN_R615"]), build("r580.so", &[]))
    })
}

/// A private copy of a stand-in (its own library state) with `table` beside it.
fn standin(r615: bool, table: &str) -> (tempfile::TempDir, PathBuf) {
    let (new, old) = built();
    let dir = tempfile::tempdir().expect("tempdir");
    let library = dir.path().join("libnvidia-ml.so.1");
    std::fs::copy(if r615 { new } else { old }, &library).expect("copy the stand-in");
    let mut table_path = library.clone().into_os_string();
    table_path.push(".table");
    std::fs::write(table_path, table).expect("table");
    (dir, library)
}

fn open(library: &Path) -> Result<DriverLimits, Unavailable> {
    DriverLimits::open_at(library.as_os_str())
}

#[test]
fn an_r580_driver_is_unavailable_with_its_version() {
    let (_dir, library) = standin(false, "");
    let error = open(&library).expect_err("no limit call in driver 580");
    assert_eq!(error, Unavailable::Symbol { symbol: "nvmlDeviceGetMemoryLimits_v1", driver: "580.159.04".to_owned() });
    let message = error.to_string();
    assert!(message.contains("driver 580.159.04") && message.contains("R615"), "{message}");
}

#[test]
fn a_missing_library_is_unavailable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let error = DriverLimits::open_at(dir.path().join("libnvidia-ml.so.1").as_os_str()).expect_err("no library");
    assert!(matches!(error, Unavailable::Library(_)), "{error:?}");
    // A library that is not NVML at all (libc has none of its entry points).
    let error = DriverLimits::open_at(OsStr::new("libc.so.6")).expect_err("not NVML");
    assert_eq!(error, Unavailable::Symbol { symbol: "nvmlInit_v2", driver: "unknown".to_owned() });
}

#[test]
fn an_r615_driver_reads_set_not_set_and_not_supported() {
    let table = format!(
        "{CGROUP} 4294967296 8589934592 1073741824\n\
         /sys/fs/cgroup/soft-only 2147483648 18446744073709551615 0\n\
         /sys/fs/cgroup/cleared 0 18446744073709551615 5\n\
         /sys/fs/cgroup/none NOT_FOUND\n\
         /sys/fs/cgroup/mig NOT_SUPPORTED\n"
    );
    let (_dir, library) = standin(true, &table);
    let limits = open(&library).expect("R615-shaped stand-in");
    assert_eq!(limits.driver_version().as_deref(), Some("615.10.00"));

    let set = limits.read(GPU, Path::new(CGROUP)).expect("read");
    assert_eq!(set, Reading::Set(Limits { soft: 4 << 30, hard: 8 << 30, used: 1 << 30 }));
    let Reading::Set(l) = set else { unreachable!() };
    assert_eq!((l.soft_limit(), l.hard_limit()), (Some(4 << 30), Some(8 << 30)));

    let Reading::Set(soft_only) = limits.read(GPU, Path::new("/sys/fs/cgroup/soft-only")).expect("read") else {
        panic!("set")
    };
    assert_eq!((soft_only.soft_limit(), soft_only.hard_limit()), (Some(2 << 30), None));
    // Cleared (soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX): set, but neither limit is one.
    let Reading::Set(cleared) = limits.read(GPU, Path::new("/sys/fs/cgroup/cleared")).expect("read") else {
        panic!("set")
    };
    assert_eq!((cleared.soft_limit(), cleared.hard_limit(), cleared.used), (None, None, 5));

    assert_eq!(limits.read(GPU, Path::new("/sys/fs/cgroup/none")), Ok(Reading::NotSet));
    assert_eq!(limits.read(GPU, Path::new("/sys/fs/cgroup/not-in-the-table")), Ok(Reading::NotSet));
    assert_eq!(limits.read(GPU, Path::new("/sys/fs/cgroup/mig")), Ok(Reading::NotSupported));
    // Another GPU: the handle lookup's own error, named.
    assert_eq!(
        limits.read("GPU-elsewhere", Path::new(CGROUP)),
        Err(ReadError::Nvml { call: "nvmlDeviceGetHandleByUUID", code: 6 })
    );
}

#[test]
fn a_nul_byte_is_refused_before_any_call() {
    let (_dir, library) = standin(true, "");
    let limits = open(&library).expect("open");
    assert_eq!(limits.read(GPU, Path::new("/sys/fs/cgroup/a\0b")), Err(ReadError::Nul("cgroup path")));
    assert_eq!(limits.read("GPU-\0", Path::new(CGROUP)), Err(ReadError::Nul("GPU UUID")));
    let message = ReadError::Nul("cgroup path").to_string();
    assert_eq!(message, "cgroup path contains a NUL byte");
}

#[test]
fn the_struct_is_laid_out_as_the_c_compiler_lays_out_the_headers() {
    // The stand-in writes its own struct's offsets and size (compiled from the nvml.h declaration) through
    // the pointer the crate passes: what the crate reads back is where C put each field.
    let (_dir, library) = standin(true, "/sys/fs/cgroup/layout LAYOUT\n");
    let limits = open(&library).expect("open");
    let Ok(Reading::Set(seen)) = limits.read(GPU, Path::new("/sys/fs/cgroup/layout")) else { panic!("set") };
    assert_eq!((seen.soft, seen.hard, seen.used), (8, 16, 32), "offsets of softLimit, hardLimit; sizeof");
}

#[test]
fn every_init_is_shut_down_on_drop() {
    let (_dir, library) = standin(true, "/sys/fs/cgroup/inits INITS\n");
    let first = open(&library).expect("open");
    let inits = |l: &DriverLimits| match l.read(GPU, Path::new("/sys/fs/cgroup/inits")) {
        Ok(Reading::Set(Limits { used, .. })) => used,
        other => panic!("{other:?}"),
    };
    assert_eq!(inits(&first), 1);
    let second = open(&library).expect("open again");
    assert_eq!(inits(&first), 2);
    drop(second);
    assert_eq!(inits(&first), 1, "the second handle's nvmlShutdown ran");
}

/// `--apply-driver-limits`: what is set is read back; the driver's refusals are named; nothing invalid is sent.
#[test]
fn limits_set_are_read_back_and_refusals_are_named() {
    let table = "/sys/fs/cgroup/mig NOT_SUPPORTED\n/sys/fs/cgroup/unprivileged DENY\n";
    let (_dir, library) = standin(true, table);
    let limits = open(&library).expect("R615-shaped stand-in");
    assert!(limits.can_set());
    assert_eq!(limits.read(GPU, Path::new(CGROUP)), Ok(Reading::NotSet));
    limits.set(GPU, Path::new(CGROUP), 4 << 30, 8 << 30).expect("set");
    assert_eq!(limits.read(GPU, Path::new(CGROUP)), Ok(Reading::Set(Limits { soft: 4 << 30, hard: 8 << 30, used: 0 })));
    // Lowered again: the new figures are what the driver answers.
    limits.set(GPU, Path::new(CGROUP), 0, 6 << 30).expect("set");
    let Ok(Reading::Set(now)) = limits.read(GPU, Path::new(CGROUP)) else { panic!("set") };
    assert_eq!((now.soft_limit(), now.hard_limit()), (None, Some(6 << 30)));
    let nvml = |code| Err(SetError::Nvml { call: "nvmlDeviceSetMemoryLimits_v1", code });
    assert_eq!(limits.set(GPU, Path::new("/sys/fs/cgroup/mig"), 0, 1 << 30), nvml(3), "not supported (MIG)");
    assert_eq!(limits.set(GPU, Path::new("/sys/fs/cgroup/unprivileged"), 0, 1 << 30), nvml(4), "not root");
    assert_eq!(
        limits.set("GPU-elsewhere", Path::new(CGROUP), 0, 1 << 30),
        Err(SetError::Nvml { call: "nvmlDeviceGetHandleByUUID", code: 6 })
    );
    assert_eq!(limits.set(GPU, Path::new(CGROUP), 2, 1), Err(SetError::Invalid("a soft limit above the hard one")));
    assert!(matches!(limits.set(GPU, Path::new("/a\0b"), 0, 1), Err(SetError::Invalid(_))));
}

#[test]
fn the_setters_struct_is_laid_out_as_the_c_compiler_lays_out_the_headers() {
    // The stand-in's setter, for this path, records its own struct's offsets and size, read back by the getter.
    let (_dir, library) = standin(true, "/sys/fs/cgroup/layout LAYOUT\n");
    let limits = open(&library).expect("open");
    limits.set(GPU, Path::new("/sys/fs/cgroup/layout"), 1, 2).expect("set");
    let Ok(Reading::Set(seen)) = limits.read(GPU, Path::new("/sys/fs/cgroup/layout")) else { panic!("set") };
    assert_eq!((seen.soft, seen.hard, seen.used), (8, 16, 24), "offsets of softLimit, hardLimit; sizeof");
}

#[test]
fn an_r580_driver_cannot_set() {
    // Not even opened: the getter is missing, so the agent reports the driver's limits unavailable (once).
    let (_dir, library) = standin(false, "");
    assert!(open(&library).is_err());
}
