//! The benchmark's control channel: a plain TCP connection carrying one text
//! line per command, used to swap plugin handles and to pace each test.
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

pub struct Ctl {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Ctl {
    pub fn new(s: TcpStream) -> std::io::Result<Ctl> {
        s.set_nodelay(true)?;
        Ok(Ctl { r: BufReader::new(s.try_clone()?), w: s })
    }

    pub fn send(&mut self, line: &str) -> std::io::Result<()> {
        writeln!(self.w, "{line}")?;
        self.w.flush()
    }

    pub fn recv(&mut self) -> std::io::Result<String> {
        let mut l = String::new();
        if self.r.read_line(&mut l)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "control connection closed by the peer"));
        }
        Ok(l.trim_end().to_string())
    }

    /// Expect a line starting with `prefix`; return the rest.
    pub fn expect(&mut self, prefix: &str) -> Result<String, String> {
        let l = self.recv().map_err(|e| e.to_string())?;
        l.strip_prefix(prefix).map(|s| s.trim().to_string()).ok_or_else(|| format!("expected {prefix:?} from the peer, got {l:?}"))
    }
}

/// A byte count as the tools take it (`4096`, `64K`, `1M`, `1G`): the same
/// syntax as the plugin's byte-size knobs, parsed by the same code.
pub fn parse_size(s: &str) -> Option<usize> {
    <rustnet::for_tools::config::Bytes as rustnet::for_tools::config::KnobValue>::parse_knob(s.trim())
        .and_then(|b| usize::try_from(b.0).ok())
}
