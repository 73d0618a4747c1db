package core

import "time"

// Status queries: which of an exporter's buffers still live. The cache's
// poller asks (cache.go) to undo mappings nobody references once their
// buffer has ended; the server answers before any hello (session.go).
// bufferStatus asks t's exporter which of the buffer ids are still live.
// The answer is unauthenticated: it only decides when to drop cached
// mappings early, never whether to use one.
func bufferStatus(t *Ticket, ids []uint64, timeout time.Duration) (map[uint64]bool, error) {
	if err := checkBeforeDial(t); err != nil {
		return nil, err
	}
	c, err := dialConn(t, time.Now().Add(timeout), timeout)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	out := make(map[uint64]bool, len(ids))
	for _, id := range ids {
		if err := c.send(statusMsg{BufferID: id}.encode(), -1); err != nil {
			return nil, err
		}
		f, err := recvControl(c, "status-ack")
		if err != nil {
			return nil, err
		}
		ack, err := parseStatusAck(f.Body)
		if err != nil {
			return nil, err
		}
		if ack.BufferID != id {
			return nil, Errorf(EINVAL, "protocol: status of buffer %d answered for buffer %d", id, ack.BufferID)
		}
		out[id] = ack.Alive
	}
	return out, nil
}
