package kvevents

import (
	"fmt"
	"testing"
)

// benchPayloads builds batches shaped like vLLM's under prefill load: each
// batch holds BlockStored events of 16 blocks of 16 tokens (one 256-token
// prompt chunk each), chained after the previous event, plus BlockRemoved for
// blocks stored earlier so the index stays bounded.
func benchPayloads(b *testing.B, enc Encoding, nBatches int) ([][]byte, int) {
	const bs, perEvent, eventsPerBatch = 16, 16, 4
	var payloads [][]byte
	h := uint64(1)
	stored := 0
	var window []uint64
	for i := range nBatches {
		var evs []Event
		parent, hasParent := uint64(0), false
		for range eventsPerBatch {
			ev := BlockStored{ParentHash: parent, HasParent: hasParent, BlockSize: bs, Medium: MediumGPU}
			for range perEvent {
				ev.BlockHashes = append(ev.BlockHashes, h)
				window = append(window, h)
				h++
				for t := range bs {
					ev.TokenIDs = append(ev.TokenIDs, uint32((int(h)*31+t*7)%128000))
				}
			}
			parent, hasParent = h-1, true
			stored += perEvent
			evs = append(evs, ev)
		}
		if len(window) > 4096 {
			evs = append(evs, BlockRemoved{BlockHashes: window[:eventsPerBatch*perEvent], Medium: MediumGPU})
			window = window[eventsPerBatch*perEvent:]
		}
		p, err := EncodeBatch(Batch{TS: float64(i), Events: evs}, enc)
		if err != nil {
			b.Fatal(err)
		}
		payloads = append(payloads, p)
	}
	return payloads, stored / nBatches
}

// BenchmarkDecodeApply measures the subscriber's hot path on one core: decode
// a batch and apply it to the index (router keys from token ids, hash map
// updates, Sink calls). Run with -cpu 1.
func BenchmarkDecodeApply(b *testing.B) {
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		b.Run(enc.String(), func(b *testing.B) {
			payloads, perBatch := benchPayloads(b, enc, 256)
			ix := NewIndex()
			b.ReportAllocs()
			b.ResetTimer()
			blocksDone := 0
			for i := 0; b.Loop(); i++ {
				batch, err := DecodeBatch(payloads[i%len(payloads)])
				if err != nil {
					b.Fatal(err)
				}
				// Each batch's chains start within it, so parents are always
				// known; the removals keep the index at a steady ~4-8K blocks.
				if _, err := ix.Apply("r", batch.Events, NopSink{}); err != nil {
					b.Fatal(fmt.Errorf("batch %d: %w", i, err))
				}
				blocksDone += perBatch
			}
			b.ReportMetric(float64(blocksDone)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// BenchmarkDecode isolates decoding.
func BenchmarkDecode(b *testing.B) {
	payloads, perBatch := benchPayloads(b, EncodingArray, 64)
	b.ReportAllocs()
	n := 0
	for i := 0; b.Loop(); i++ {
		if _, err := DecodeBatch(payloads[i%len(payloads)]); err != nil {
			b.Fatal(err)
		}
		n += perBatch
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "blocks/s")
}
