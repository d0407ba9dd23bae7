//! Inserting the plugin into the node's primary CNI configuration, and
//! taking it out again, as text edits that leave every other byte alone.
//!
//! The primary configuration is the first file of the CNI configuration
//! directory, by name, ending in `.conflist`, `.conf` or `.json` (the
//! file the runtime uses). In a configuration list the plugin is appended
//! to `plugins` (once: an existing entry is updated in place, duplicates
//! dropped); every other plugin entry and every top-level field is kept
//! byte for byte. A lone plugin configuration (`.conf`) becomes a list
//! (`.conflist`, same stem) holding the original text as its first plugin;
//! the plugin entry then records `convertedFrom`, and removal writes the
//! original `.conf` back.
//!
//! Edits find their spans with borrowed [`RawValue`]s: serde_json parses
//! the file and hands back slices of the original text.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Value, value::RawValue};

use crate::cni::spec::PLUGIN_TYPE;

/// Field of the plugin's entry naming the `.conf` it was converted from.
pub const CONVERTED_FROM: &str = "convertedFrom";

/// Errors reading a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfError {
    /// The file is not JSON, or not a CNI configuration.
    #[error("{path} is not a valid CNI configuration")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        #[source]
        source: serde_json::Error,
    },
    /// Converting a `.conf` would overwrite another file.
    #[error("cannot convert {path} to a list: {target} already exists")]
    TargetExists {
        /// The `.conf`.
        path: PathBuf,
        /// The `.conflist` that would be written.
        target: PathBuf,
    },
}

/// A change to make on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    /// File to write (atomically).
    pub write: PathBuf,
    /// Its new content.
    pub text: String,
    /// File to delete once the write is done.
    pub delete: Option<PathBuf>,
}

/// Whether `name` is a configuration file the runtime would load.
pub fn is_config_name(name: &str) -> bool {
    !name.starts_with('.')
        && [".conflist", ".conf", ".json"]
            .iter()
            .any(|ext| name.ends_with(ext))
}

/// The primary configuration in `dir`, if any.
pub fn primary(dir: &Path) -> std::io::Result<Option<PathBuf>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_config_name(n))
        .collect();
    names.sort();
    Ok(names.into_iter().next().map(|n| dir.join(n)))
}

/// The fields of a configuration the edits need, borrowed from its text.
#[derive(Deserialize)]
struct TopLevel<'a> {
    #[serde(borrow, default)]
    plugins: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "cniVersion")]
    cni_version: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct TypeOnly {
    #[serde(default, rename = "type")]
    plugin_type: Option<String>,
    #[serde(default, rename = "convertedFrom")]
    converted_from: Option<String>,
}

fn invalid(path: &Path) -> impl FnOnce(serde_json::Error) -> ConfError + '_ {
    move |source| ConfError::Invalid {
        path: path.to_path_buf(),
        source,
    }
}

/// A configuration list's `plugins` array, located in the file's text.
struct PluginArray<'a> {
    /// Byte range of the array (brackets included) in the text.
    start: usize,
    end: usize,
    /// Each element's text.
    elements: Vec<&'a str>,
    /// Whitespace after `[`, between elements (with the comma), before `]`.
    open: &'a str,
    separator: String,
    close: &'a str,
}

fn offset(text: &str, part: &str) -> usize {
    part.as_ptr() as usize - text.as_ptr() as usize
}

impl<'a> PluginArray<'a> {
    fn locate(path: &Path, text: &'a str, array: &'a RawValue) -> Result<Self, ConfError> {
        let raw = array.get();
        let elements: Vec<&'a RawValue> = serde_json::from_str(raw).map_err(invalid(path))?;
        let elements: Vec<&'a str> = elements.into_iter().map(RawValue::get).collect();
        let start = offset(text, raw);
        let end = start + raw.len();
        let (open, close, separator) = match (elements.first(), elements.last()) {
            (Some(first), Some(last)) => {
                let open = &raw[1..offset(raw, first)];
                let close = &raw[offset(raw, last) + last.len()..raw.len() - 1];
                let separator = match elements.get(1) {
                    Some(second) => {
                        raw[offset(raw, first) + first.len()..offset(raw, second)].to_owned()
                    }
                    None => format!(",{open}"),
                };
                (open, close, separator)
            }
            _ => ("\n    ", "\n  ", ",\n    ".to_owned()),
        };
        Ok(Self {
            start,
            end,
            elements,
            open,
            separator,
            close,
        })
    }

    /// The indentation of elements (the text after the last newline of
    /// the opening whitespace).
    fn indent(&self) -> &str {
        self.open.rsplit('\n').next().unwrap_or("")
    }

    fn render(&self, elements: &[String]) -> String {
        format!(
            "[{}{}{}]",
            self.open,
            elements.join(&self.separator),
            self.close
        )
    }
}

fn is_ours(element: &str) -> Option<TypeOnly> {
    serde_json::from_str::<TypeOnly>(element)
        .ok()
        .filter(|t| t.plugin_type.as_deref() == Some(PLUGIN_TYPE))
}

/// `value` pretty-printed, continuation lines indented by `indent`.
fn pretty(value: &Value, indent: &str) -> String {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    text.replace('\n', &format!("\n{indent}"))
}

/// Inserts (or updates) `ours`, the plugin's configuration object, in the
/// configuration at `path` whose content is `text`. `None` when the file
/// already holds exactly that.
pub fn insert(path: &Path, text: &str, ours: &Value) -> Result<Option<Edit>, ConfError> {
    let top: TopLevel<'_> = serde_json::from_str(text).map_err(invalid(path))?;
    let Some(plugins) = top.plugins else {
        return convert(path, text, &top, ours).map(Some);
    };
    let array = PluginArray::locate(path, text, plugins)?;
    let existing: Vec<(usize, TypeOnly)> = array
        .elements
        .iter()
        .enumerate()
        .filter_map(|(i, e)| is_ours(e).map(|t| (i, t)))
        .collect();
    let mut desired = ours.clone();
    if let (Some((_, found)), Some(obj)) = (existing.first(), desired.as_object_mut())
        && let Some(from) = &found.converted_from
    {
        obj.insert(CONVERTED_FROM.into(), Value::String(from.clone()));
    }
    if let [(i, _)] = existing.as_slice() {
        let current: Value = serde_json::from_str(array.elements[*i]).map_err(invalid(path))?;
        if current == desired {
            return Ok(None);
        }
    }
    let mut kept: Vec<String> = array
        .elements
        .iter()
        .filter(|e| is_ours(e).is_none())
        .map(|e| (*e).to_owned())
        .collect();
    kept.push(pretty(&desired, array.indent()));
    let new_text = format!(
        "{}{}{}",
        &text[..array.start],
        array.render(&kept),
        &text[array.end..]
    );
    Ok(Some(Edit {
        write: path.to_path_buf(),
        text: new_text,
        delete: None,
    }))
}

/// A lone plugin configuration turned into a list with `ours` after it.
fn convert(path: &Path, text: &str, top: &TopLevel<'_>, ours: &Value) -> Result<Edit, ConfError> {
    let target = path.with_extension("conflist");
    if target.exists() && target != path {
        return Err(ConfError::TargetExists {
            path: path.to_path_buf(),
            target,
        });
    }
    let mut desired = ours.clone();
    if let (Some(obj), Some(name)) = (
        desired.as_object_mut(),
        path.file_name().and_then(|n| n.to_str()),
    ) {
        obj.insert(CONVERTED_FROM.into(), Value::String(name.to_owned()));
    }
    let mut fields = Vec::new();
    if let Some(version) = top.cni_version {
        fields.push(format!("  \"cniVersion\": {}", version.get()));
    }
    if let Some(name) = top.name {
        fields.push(format!("  \"name\": {}", name.get()));
    }
    fields.push(format!(
        "  \"plugins\": [\n    {},\n    {}\n  ]",
        text.trim(),
        pretty(&desired, "    ")
    ));
    Ok(Edit {
        write: target.clone(),
        text: format!("{{\n{}\n}}\n", fields.join(",\n")),
        delete: (target != path).then(|| path.to_path_buf()),
    })
}

/// Takes the plugin out of the configuration at `path`. `None` when it is
/// not there.
pub fn remove(path: &Path, text: &str) -> Result<Option<Edit>, ConfError> {
    let top: TopLevel<'_> = serde_json::from_str(text).map_err(invalid(path))?;
    let Some(plugins) = top.plugins else {
        return Ok(None);
    };
    let array = PluginArray::locate(path, text, plugins)?;
    let ours: Vec<TypeOnly> = array.elements.iter().filter_map(|e| is_ours(e)).collect();
    if ours.is_empty() {
        return Ok(None);
    }
    let kept: Vec<String> = array
        .elements
        .iter()
        .filter(|e| is_ours(e).is_none())
        .map(|e| (*e).to_owned())
        .collect();
    let converted_from = ours.iter().find_map(|t| t.converted_from.clone());
    if let (Some(from), [original]) = (converted_from, kept.as_slice()) {
        let original_path = path.with_file_name(&from);
        if !original_path.exists() && is_config_name(&from) {
            return Ok(Some(Edit {
                write: original_path,
                text: format!("{original}\n"),
                delete: Some(path.to_path_buf()),
            }));
        }
    }
    let new_text = format!(
        "{}{}{}",
        &text[..array.start],
        array.render(&kept),
        &text[array.end..]
    );
    Ok(Some(Edit {
        write: path.to_path_buf(),
        text: new_text,
        delete: None,
    }))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    fn ours() -> Value {
        serde_json::json!({"type": PLUGIN_TYPE, "agentSocket": "/run/dataplane/default/agent.sock"})
    }

    const CALICO: &str = r#"{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {
      "type": "calico",
      "log_level": "info",
      "datastore_type": "kubernetes",
      "mtu": 1440,
      "ipam": { "type": "calico-ipam" },
      "policy": { "type": "k8s" },
      "kubernetes": { "kubeconfig": "/etc/cni/net.d/calico-kubeconfig" }
    },
    {
      "type": "portmap",
      "snat": true,
      "capabilities": {"portMappings": true}
    }
  ]
}
"#;

    #[test]
    fn list_gets_the_plugin_appended_and_keeps_every_other_byte() {
        let path = Path::new("/x/10-calico.conflist");
        let edit = insert(path, CALICO, &ours()).unwrap().unwrap();
        assert_eq!(edit.write, path);
        let v: Value = serde_json::from_str(&edit.text).unwrap();
        let plugins = v["plugins"].as_array().unwrap();
        assert_eq!(plugins.len(), 3);
        assert_eq!(plugins[2], ours());
        // Unchanged prefix up to the end of the portmap entry.
        let portmap_end = CALICO.find("}\n    }").unwrap() + 7;
        assert_eq!(&edit.text[..portmap_end], &CALICO[..portmap_end]);
        assert!(edit.text.ends_with("  ]\n}\n"));
        // Idempotent.
        assert_eq!(insert(path, &edit.text, &ours()).unwrap(), None);
        // Removal restores the original exactly.
        let removed = remove(path, &edit.text).unwrap().unwrap();
        assert_eq!(removed.text, CALICO);
    }

    #[test]
    fn changed_settings_update_the_entry_in_place_once() {
        let path = Path::new("/x/10-calico.conflist");
        let first = insert(path, CALICO, &ours()).unwrap().unwrap();
        let mut changed = ours();
        changed["onAgentUnreachable"] = "pass".into();
        let second = insert(path, &first.text, &changed).unwrap().unwrap();
        let v: Value = serde_json::from_str(&second.text).unwrap();
        assert_eq!(v["plugins"].as_array().unwrap().len(), 3);
        assert_eq!(v["plugins"][2]["onAgentUnreachable"], "pass");
    }

    #[test]
    fn lone_conf_becomes_a_list_and_comes_back() {
        let conf = r#"{"cniVersion":"1.0.0","name":"bridge","type":"bridge","bridge":"cni0","ipam":{"type":"host-local","subnet":"10.88.0.0/16"}}"#;
        let path = Path::new("/nonexistent-dir/10-bridge.conf");
        let edit = insert(path, conf, &ours()).unwrap().unwrap();
        assert_eq!(edit.write, Path::new("/nonexistent-dir/10-bridge.conflist"));
        assert_eq!(edit.delete.as_deref(), Some(path));
        let v: Value = serde_json::from_str(&edit.text).unwrap();
        assert_eq!(v["cniVersion"], "1.0.0");
        assert_eq!(v["name"], "bridge");
        assert_eq!(
            v["plugins"][0],
            serde_json::from_str::<Value>(conf).unwrap()
        );
        assert_eq!(v["plugins"][1]["convertedFrom"], "10-bridge.conf");
        let list_path = Path::new("/nonexistent-dir/10-bridge.conflist");
        assert_eq!(insert(list_path, &edit.text, &ours()).unwrap(), None);
        let back = remove(list_path, &edit.text).unwrap().unwrap();
        assert_eq!(back.write, path);
        assert_eq!(back.text, format!("{conf}\n"));
        assert_eq!(back.delete.as_deref(), Some(list_path));
    }

    #[test]
    fn duplicates_collapse_to_one() {
        let text = r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"dataplane-cni"},{"type":"ptp"},{"type":"dataplane-cni","x":1}]}"#;
        let edit = insert(Path::new("/x/a.conflist"), text, &ours())
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_str(&edit.text).unwrap();
        let types: Vec<&str> = v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(types, ["ptp", PLUGIN_TYPE]);
    }

    #[test]
    fn config_names() {
        assert!(is_config_name("10-calico.conflist"));
        assert!(is_config_name("87-podman.conf"));
        assert!(is_config_name("05-cilium.json"));
        assert!(!is_config_name("calico-kubeconfig"));
        assert!(!is_config_name(".10-x.conflist.tmp"));
        assert!(!is_config_name("ZZZ-dataplane-cni-kubeconfig"));
    }
}
