//! A Helm post-renderer for the real API server tier (`helm install|upgrade --post-renderer`): reads the
//! release's manifests on stdin, puts its webhook configurations in URL mode ([`gpubudget_e2e::url_mode`]) and
//! writes them all to stdout, each as JSON. Arguments: the operator's webhook address (`127.0.0.1:<port>`) and the base64 CA
//! bundle that signed its certificate.

use std::io::{Read, Write};

use serde::Deserialize;
use serde_json::Value;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [host, ca_bundle] = args.as_slice() else {
        eprintln!("usage: gpubudget-e2e-url-mode <webhook host:port> <CA bundle, base64> < manifests");
        std::process::exit(2);
    };
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input).expect("the manifests read from stdin");
    let mut out = String::new();
    for document in serde_yaml::Deserializer::from_str(&input) {
        let mut object = Value::deserialize(document).expect("a manifest parses");
        if object.is_null() {
            continue;
        }
        gpubudget_e2e::url_mode(&mut object, host, ca_bundle);
        // As JSON (YAML too, for Helm): no plain scalar that YAML 1.1 (Helm's parser) would read as another
        // type than YAML 1.2 (serde_yaml's), such as an env value `on` or `yes`.
        out.push_str("---\n");
        out.push_str(&serde_json::to_string(&object).expect("a manifest serializes"));
        out.push('\n');
    }
    std::io::stdout().write_all(out.as_bytes()).expect("the manifests written to stdout");
}
