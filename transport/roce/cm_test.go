package roce

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func cmListener(t *testing.T) *CMListener {
	ln, err := ListenCM("127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

func TestCMExchange(t *testing.T) {
	ln := cmListener(t)
	srv := ConnParams{QPN: 0x12, PSN: 0xabcdef, MTU: 4096, Addr: netip.MustParseAddrPort("127.0.0.2:4791"), Private: []byte("server")}
	cli := ConnParams{QPN: 0x34, PSN: 1, MTU: 1024, Addr: netip.MustParseAddrPort("[fd00::1]:4791"), Private: []byte("rkey 7 at 0x1000")}
	type res struct {
		p   ConnParams
		cm  *CM
		err error
	}
	accepted := make(chan res, 1)
	go func() {
		p, cm, err := ln.Accept(context.Background(), srv)
		accepted <- res{p, cm, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, ccm, err := DialCM(ctx, ln.Addr().String(), cli)
	require.NoError(t, err)
	assert.Equal(t, srv, got)
	r := <-accepted
	require.NoError(t, r.err)
	assert.Equal(t, cli, r.p)

	// An orderly disconnect reaches the other side.
	require.NoError(t, ccm.Disconnect())
	<-r.cm.Done()
	assert.ErrorIs(t, r.cm.Err(), io.EOF)
	require.NoError(t, r.cm.Disconnect())
}

// What a hostile or broken peer sends ends the setup with ErrCM, allocating nothing
// it announces beyond the limit; a peer that never answers ends it at the deadline.
func TestCMHostilePeers(t *testing.T) {
	ln := cmListener(t)
	good, err := ConnParams{QPN: 1, PSN: 2, MTU: 1024, Addr: netip.MustParseAddrPort("127.0.0.1:4791")}.marshal()
	require.NoError(t, err)
	mut := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	for name, msg := range map[string][]byte{
		"garbage":          []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n......................."),
		"truncated":        good[:10],
		"version":          mut(func(b []byte) []byte { b[8] = 9; return b }),
		"MTU code":         mut(func(b []byte) []byte { b[9] = 7; return b }),
		"private too long": mut(func(b []byte) []byte { binary.BigEndian.PutUint16(b[10:], 60000); return b }),
		"QPN too wide":     mut(func(b []byte) []byte { binary.BigEndian.PutUint32(b[12:], 1<<24); return b }),
		"no address":       mut(func(b []byte) []byte { clear(b[20:38]); return b }),
		"no RTU":           good,
		"wrong RTU":        append(append([]byte(nil), good...), []byte("odpemuXX")...),
	} {
		errc := make(chan error, 1)
		go func() {
			_, cm, err := ln.Accept(context.Background(), ConnParams{QPN: 9, MTU: 1024, Addr: netip.MustParseAddrPort("127.0.0.1:4791")})
			if cm != nil {
				_ = cm.Disconnect()
			}
			errc <- err
		}()
		c, err := net.Dial("tcp", ln.Addr().String())
		require.NoError(t, err)
		_, err = c.Write(msg)
		require.NoError(t, err)
		if name == "truncated" || name == "no RTU" {
			_ = c.(*net.TCPConn).CloseWrite()
		}
		assert.ErrorIs(t, <-errc, ErrCM, name)
		_ = c.Close()
	}

	// A listener that accepts and never answers: the dialer's deadline ends it.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = silent.Close() }()
	held := make(chan net.Conn, 1)
	go func() {
		c, err := silent.Accept()
		if err == nil {
			held <- c
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, _, err = DialCM(ctx, silent.Addr().String(), ConnParams{MTU: 1024, Addr: netip.MustParseAddrPort("127.0.0.1:4791")})
	assert.Error(t, err)
	_ = (<-held).Close()

	_, _, err = DialCM(context.Background(), ln.Addr().String(), ConnParams{MTU: 1000, Addr: netip.MustParseAddrPort("127.0.0.1:1")})
	assert.ErrorIs(t, err, ErrCM, "bad local parameters are refused before anything is sent")
}

// The setup orders the two sides' attaches before either may send, as rdma_cm's
// REP and RTU do: the passive side's ready runs before the active side has its
// answer, and the active side's before the passive side's AcceptReady returns. A
// ready that fails ends the setup on both sides.
func TestCMReady(t *testing.T) {
	ln := cmListener(t)
	srv := ConnParams{QPN: 0x12, PSN: 5, MTU: 1024, Addr: netip.MustParseAddrPort("127.0.0.2:4791")}
	cli := ConnParams{QPN: 0x34, PSN: 6, MTU: 1024, Addr: netip.MustParseAddrPort("127.0.0.1:4791")}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, fail := range []string{"", "passive", "active"} {
		var srvReady, cliReady atomic.Bool
		refused := errors.New("refused")
		accepted := make(chan error, 1)
		go func() {
			got, cm, err := ln.AcceptReady(ctx, srv, func(r ConnParams) error {
				assert.Equal(t, cli.QPN, r.QPN)
				srvReady.Store(true)
				if fail == "passive" {
					return refused
				}
				return nil
			})
			if err == nil {
				assert.Equal(t, cli, got)
				assert.True(t, cliReady.Load(), "the active side was ready before the passive side's setup ended")
				<-cm.Done() // the active side disconnects
			}
			accepted <- err
		}()
		got, cm, err := DialCMReady(ctx, ln.Addr().String(), cli, func(r ConnParams) error {
			assert.Equal(t, srv, r)
			assert.True(t, srvReady.Load(), "the passive side was ready before it answered")
			cliReady.Store(true)
			if fail == "active" {
				return refused
			}
			return nil
		})
		switch fail {
		case "":
			require.NoError(t, err)
			assert.Equal(t, srv, got)
			require.NoError(t, cm.Disconnect())
			require.NoError(t, <-accepted)
		case "passive":
			assert.ErrorIs(t, err, ErrCM, "the active side learns of it: no answer")
			assert.False(t, cliReady.Load())
			assert.ErrorIs(t, <-accepted, refused)
		case "active":
			assert.ErrorIs(t, err, refused)
			assert.ErrorIs(t, <-accepted, ErrCM, "the passive side learns of it: no RTU")
		}
	}
}
