//go:build unix

package brokers

import (
	"fmt"
	mrand "math/rand/v2"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
)

// publication is one copy of one message, in the order the test publishes.
type publication struct {
	id      string // the Watermill UUID, the foreign producer's id, or "" (a foreign message with no id)
	foreign bool   // published by a producer that is not Watermill
	copy    int    // 1: the first copy
}

// newPlan returns what a run publishes: messages Watermill messages, and
// republish of them a second time later in the stream; foreign messages
// from another producer, each twice, the second copy later in the stream
// (foreignLater) or right after the first; and, halfway, one foreign
// message with no id at all.
func newPlan(run string, foreignLater bool) []publication {
	var plan []publication
	for range messages {
		plan = append(plan, publication{id: watermill.NewUUID(), copy: 1})
	}
	for i := range foreign {
		at := mrand.IntN(len(plan) + 1)
		plan = slices.Insert(plan, at, publication{id: fmt.Sprintf("%s-order-%d", run, i), foreign: true, copy: 1})
	}
	again := func(p publication, later bool) {
		at := slices.Index(plan, p) + 1
		if later {
			at += mrand.IntN(len(plan) - at + 1)
		}
		p.copy = 2
		plan = slices.Insert(plan, at, p)
	}
	var watermillIDs, foreignIDs []publication
	for _, p := range plan {
		if p.foreign {
			foreignIDs = append(foreignIDs, p)
		} else {
			watermillIDs = append(watermillIDs, p)
		}
	}
	for _, i := range mrand.Perm(len(watermillIDs))[:republish] {
		again(watermillIDs[i], true)
	}
	for _, p := range foreignIDs {
		again(p, foreignLater)
	}
	return slices.Insert(plan, len(plan)/2, publication{foreign: true, copy: 1})
}
