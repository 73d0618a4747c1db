package core

import (
	"bufio"
	"encoding/hex"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The impostor helper: a plain socket at an exporter's address that answers
// receivers the way an attacker could, and records every byte they send it;
// and the test's question to it (report).

// helperImpostor listens at VMMIPC_TEST_ADDR with a plain socket (or on the
// inherited listening descriptor VMMIPC_TEST_LISTEN_FD), says "listening
// <pid>", and answers each connection per VMMIPC_TEST_LISTEN_MODE:
//
//	count     says nothing; "read <n>" once the peer closed
//	silent    says nothing
//	pushfd    sends a welcome with a descriptor attached, at once
//	skipauth  answers a hello with a welcome and a descriptor (no proof)
//	fakeproof answers a hello with a challenge whose proof is random (it
//	          does not know the secret)
//	replay    answers a hello with the message in VMMIPC_TEST_REPLAY (a
//	          challenge the real exporter gave someone else)
//	relay     relays each connection, bytes and descriptors both ways, to
//	          the exporter's socket it swapped away (VMMIPC_TEST_TAKE=swap)
//
// It records every byte it receives. "report" on stdin waits (up to 5 s)
// until every peer has closed and answers "report <connections> <hex of
// all bytes received, or ->"; "relayed" answers "relayed <descriptors
// that crossed the relay>"; "restore" puts a swapped socket back
// ("restored").
func helperImpostor(t *testing.T, out *lineWriter) error {
	var ln net.Listener
	var err error
	if v := os.Getenv(envListenFD); v != "" {
		fd, _ := strconv.Atoi(v)
		ln, err = net.FileListener(os.NewFile(uintptr(fd), "inherited listener"))
	} else {
		ln, err = impostorListen(os.Getenv(envAddr))
	}
	if err != nil {
		return err
	}
	mode := os.Getenv(envListenMode)
	replay, err := hex.DecodeString(os.Getenv(envReplay))
	if err != nil {
		return err
	}
	var (
		mu        sync.Mutex
		conns     int    // accepted so far
		open      int    // of which not yet closed by the peer
		received  []byte // every byte, in order of the peers' closing
		relayed   int    // descriptors relayed
		restoring atomic.Bool
	)
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			switch in.Text() {
			case "relayed":
				mu.Lock()
				out.printf("relayed %d", relayed)
				mu.Unlock()
				continue
			case "restore":
				restoring.Store(true)
				ln.Close()
				if err := restoreSwapped(os.Getenv(envAddr)); err != nil {
					out.printf("error %v", err)
				} else {
					out.printf("restored")
				}
				continue
			case "report":
			default:
				out.printf("error bad command %q", in.Text())
				continue
			}
			if !waitUntil(5*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return open == 0 }) {
				out.printf("error a peer still holds its connection open 5 s later")
				continue
			}
			mu.Lock()
			h := hex.EncodeToString(received)
			if h == "" {
				h = "-"
			}
			out.printf("report %d %s", conns, h)
			mu.Unlock()
		}
	}()
	out.printf("listening %d", os.Getpid())
	for {
		c, err := ln.Accept()
		if err != nil && restoring.Load() {
			select {} // the test ends us
		}
		if err != nil {
			return err
		}
		uc := c.(*net.UnixConn)
		mu.Lock()
		conns++
		open++
		mu.Unlock()
		go func() {
			defer uc.Close()
			if mode == "pushfd" {
				sendWithDescriptor(t, uc, welcomeMsg{Count: 1, Total: 4096, Kind: MemoryHost, BufferID: 1}.encode())
			}
			var got []byte
			var hdr [headerSize]byte
			if mode == "relay" {
				var fds int
				got, fds = relaySwapped(uc, os.Getenv(envAddr))
				mu.Lock()
				relayed += fds
				mu.Unlock()
			} else if _, err := io.ReadFull(uc, hdr[:]); err == nil {
				got = append(got, hdr[:]...)
				h, err := parseHeader(hdr[:])
				body := make([]byte, h.Len)
				if err == nil {
					_, err = io.ReadFull(uc, body)
					got = append(got, body...)
				}
				if err == nil && h.Type == msgHello {
					answerHello(t, uc, mode, replay)
				}
			}
			rest, _ := io.ReadAll(uc)
			got = append(got, rest...)
			mu.Lock()
			received = append(received, got...)
			open--
			mu.Unlock()
			if mode == "count" {
				out.printf("read %d", len(got))
			}
		}()
	}
}

// answerHello is an impostor's answer to a receiver's hello.
func answerHello(t *testing.T, uc *net.UnixConn, mode string, replay []byte) {
	switch mode {
	case "skipauth":
		sendWithDescriptor(t, uc, welcomeMsg{Count: 1, Total: 4096, Kind: MemoryHost, BufferID: 1}.encode())
	case "fakeproof":
		var m challengeMsg
		ns, _ := newNonce()
		proof, _ := random32("fake proof")
		m.Nonce, m.Proof = ns, proof
		_, _ = uc.Write(m.encode())
	case "replay":
		_, _ = uc.Write(replay)
	}
}

// sendWithDescriptor sends msg with a memfd of one page attached.
func sendWithDescriptor(t *testing.T, uc *net.UnixConn, msg []byte) {
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	_, _, _ = uc.WriteMsgUnix(msg, unix.UnixRights(fd), nil)
}

// report asks an impostor what it received: how many connections, and
// every byte.
func (h *helper) report() (conns int, received []byte) {
	h.t.Helper()
	h.send("report")
	return parseReport(h.t, h.expect("report ", 10*time.Second))
}
