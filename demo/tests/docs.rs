//! What the docs tell an operator to run names what the repository holds.

use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// docs/operations.md's removal command (the `kubectl delete` in it) removes every CRD of `crds/`: it names each
/// CRD, or deletes with `-f` a directory that holds each CRD's file.
#[test]
fn the_documented_removal_command_removes_every_crd() {
    let root = Path::new(ROOT);
    let doc = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let commands: Vec<&str> =
        doc.split('`').filter(|code| code.starts_with("kubectl delete") && code.contains("crd")).collect();
    assert_eq!(commands.len(), 1, "one removal command in docs/operations.md: {commands:?}");
    let command = commands[0];
    let words: Vec<&str> = command.split_whitespace().collect();
    let deleted_dir = words.windows(2).find(|w| w[0] == "-f").map(|w| root.join(w[1]));
    let mut crds: Vec<_> = std::fs::read_dir(root.join("crds")).unwrap().map(|e| e.unwrap().path()).collect();
    crds.sort();
    assert!(crds.len() >= 3, "{crds:?}");
    for file in crds {
        let crd: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let name = crd["metadata"]["name"].as_str().unwrap();
        let by_file = deleted_dir.as_ref().is_some_and(|dir| dir.join(file.file_name().unwrap()).is_file());
        assert!(words.contains(&name) || by_file, "`{command}` does not remove {name} ({})", file.display());
    }
}
