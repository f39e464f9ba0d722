package zmtpguard

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Defaults of Config.
const (
	// DefaultMaxFrameBytes and DefaultMaxMessageBytes: 16 MiB. vLLM's largest
	// KV-event message is one engine step's batch; its BlockStored events
	// carry the token ids of the blocks the step filled (3–5 msgpack octets
	// per token, about 1 MB for a 128k-token prompt prefilled in one step),
	// so 16 MiB is ~3M tokens in one step. It also bounds what a hostile
	// endpoint makes the router hold: zmq4 allocates each declared frame,
	// and queues up to 10 messages per socket (msgio.go, qrsize) before the
	// subscriber's own byte budget applies, so ~13 × 16 MiB per replica.
	DefaultMaxFrameBytes   = 16 << 20
	DefaultMaxMessageBytes = 16 << 20
	// DefaultMaxFrames: vLLM's messages have 3 frames, replay replies 3–5.
	DefaultMaxFrames = 64
	// DefaultHandshakeTimeout bounds the greeting and READY exchange; a
	// live peer answers in one round trip.
	DefaultHandshakeTimeout = 5 * time.Second
	// DefaultWriteTimeout: a peer that reads nothing for this long is
	// dropped. zmq4's PUB writes to its subscribers one after another
	// (pub.go, pubMWriter.sendMsg), so a subscriber that stops reading
	// would otherwise stall every other one for ever; a dropped subscriber
	// re-dials and replays what it missed.
	DefaultWriteTimeout = 10 * time.Second
	// DefaultMaxHandshakes bounds the handshakes a listener runs at once
	// (each holds a goroutine and a socket for at most HandshakeTimeout).
	DefaultMaxHandshakes = 128
)

// Config is the guard's configuration for one zmq4 socket, passed to the
// socket's constructor in its context (WithConfig). Zero fields take the
// defaults.
type Config struct {
	Limits
	// HandshakeTimeout bounds the time from TCP connect (or accept) to the
	// end of the peer's READY. Afterwards there is no read deadline: an idle
	// publisher is silent for as long as its engine is.
	HandshakeTimeout time.Duration
	// WriteTimeout bounds each write after the handshake; negative: none.
	WriteTimeout time.Duration
	// MaxHandshakes bounds a listener's concurrent handshakes; an
	// accepted connection beyond it is closed at once.
	MaxHandshakes int
	// PeerTypes, for a listener, are the peer Socket-Types accepted (zmq4's
	// SocketType.IsCompatible of the listening socket); empty: any. zmq4's
	// accept loop neither closes nor reports a connection whose handshake
	// it fails, so a listener should set them.
	PeerTypes []string
	// OnConnect, when set, is called when a dial's TCP connection is up and
	// the ZMTP handshake starts, on the dialling goroutine.
	OnConnect func()
	// OnRefuse, when set, is called once for each connection the guard
	// refuses and closes, on whichever goroutine saw it (a zmq4 reader or
	// writer, a dial, a listener's handshake): it must be safe for
	// concurrent use and must not block.
	OnRefuse func(*Error)
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		Limits: Limits{
			MaxFrameBytes:   DefaultMaxFrameBytes,
			MaxMessageBytes: DefaultMaxMessageBytes,
			MaxFrames:       DefaultMaxFrames,
		},
		HandshakeTimeout: DefaultHandshakeTimeout,
		WriteTimeout:     DefaultWriteTimeout,
		MaxHandshakes:    DefaultMaxHandshakes,
	}
}

// Validate reports the first invalid field of c, after defaulting.
func (c Config) Validate() error {
	c = c.withDefaults()
	switch {
	case c.MaxFrameBytes < 0:
		return fmt.Errorf("zmtpguard: MaxFrameBytes %d is negative", c.MaxFrameBytes)
	case c.MaxMessageBytes < 0:
		return fmt.Errorf("zmtpguard: MaxMessageBytes %d is negative", c.MaxMessageBytes)
	case c.MaxFrames < 0:
		return fmt.Errorf("zmtpguard: MaxFrames %d is negative", c.MaxFrames)
	case c.HandshakeTimeout < 0:
		return fmt.Errorf("zmtpguard: HandshakeTimeout %v is negative", c.HandshakeTimeout)
	case c.MaxHandshakes < 0:
		return fmt.Errorf("zmtpguard: MaxHandshakes %d is negative", c.MaxHandshakes)
	}
	return nil
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	if c.MaxFrameBytes == 0 {
		c.MaxFrameBytes = d.MaxFrameBytes
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = d.MaxMessageBytes
	}
	if c.MaxFrames == 0 {
		c.MaxFrames = d.MaxFrames
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = d.HandshakeTimeout
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = d.WriteTimeout
	}
	if c.MaxHandshakes == 0 {
		c.MaxHandshakes = d.MaxHandshakes
	}
	return c
}

type configKey struct{}

// WithConfig returns a context for a zmq4 socket constructor
// (zmq4.NewSub(zmtpguard.WithConfig(ctx, c))): zmq4 hands the socket's
// context to the transport's Dial and Listen, which read c from it. It
// returns an error if c is invalid.
func WithConfig(ctx context.Context, c Config) (context.Context, error) {
	if err := c.Validate(); err != nil {
		return ctx, err
	}
	return context.WithValue(ctx, configKey{}, c.withDefaults()), nil
}

// configFrom returns the config WithConfig stored in ctx, or the defaults.
func configFrom(ctx context.Context) Config {
	if c, ok := ctx.Value(configKey{}).(Config); ok {
		return c
	}
	return DefaultConfig()
}

// errClosed is returned by a listener's Accept once it is closed.
var errClosed = errors.New("zmtpguard: listener closed")
