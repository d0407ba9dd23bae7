//! Errors as logs and messages show them.

/// Displays an error with its whole source chain (`outer: inner: root`), for
/// log fields: error types keep their own message free of their source's.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            write!(f, ": {err}")?;
            source = err.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn shows_every_source_outermost_first() {
        let err = Layer(
            "reading the config",
            Some(Box::new(Layer(
                "opening /etc/x",
                Some(Box::new(Layer("no such file", None))),
            ))),
        );
        assert_eq!(
            Chain(&err).to_string(),
            "reading the config: opening /etc/x: no such file"
        );
        assert_eq!(Chain(&Layer("alone", None)).to_string(), "alone");
    }
}
