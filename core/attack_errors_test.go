package core

import (
	"net"
	"strings"
	"testing"
	"time"
)

// TestExporterCannotPickTheReceiversStatus: an exporter (here one that
// never proves itself) answering the hello with an error of any status
// makes Open fail with a status vmmipc_open lists, and that status is the
// exporter's only for those the receiver takes from a peer: EFORK,
// EINTERNAL, ENFILE and the like read as EIO, naming what it sent.
func TestExporterCannotPickTheReceiversStatus(t *testing.T) {
	for _, code := range Codes() {
		if !code.IsError() {
			continue
		}
		fake := newFakeExporter(t, 1, 4096, func(uc *net.UnixConn, tk *Ticket) {
			c, err := newConn(uc, 5*time.Second, "server")
			if err != nil {
				t.Error(err)
				return
			}
			if _, ok := recvFromReceiver(t, c, msgHello, "at first"); ok {
				_ = c.send(errorMsg{Code: code, Text: "picked by the exporter"}.encode(), -1)
			}
		})
		_, err := Open(fake.tk, OpenOptions{Timeout: 2 * time.Second})
		fake.close()
		want := EIO
		switch code {
		case EINVAL, EAUTH, ENOENT, EIO:
			want = code
		}
		if CodeOf(err) != want || !strings.Contains(err.Error(), "picked by the exporter") {
			t.Errorf("an exporter's error with %s: Open gave %v (%s), want %s with its text", code, err, CodeOf(err), want)
		}
	}
}
